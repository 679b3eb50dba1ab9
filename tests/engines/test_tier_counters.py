"""Per-tier cached tokens read from the engines' Prometheus text: TensorRT-LLM's levels, LMCache's hits."""

from __future__ import annotations

from proxy.engines.counters import parse_totals

TRTLLM = """\
# TYPE trtllm_request_success_total counter
trtllm_request_success_total{engine_type="undefined",finished_reason="stop",model_name="m"} 5
# TYPE trtllm_prompt_tokens_total counter
trtllm_prompt_tokens_total{engine_type="undefined",model_name="m"} 900
# TYPE trtllm_prompt_cached_tokens_total counter
trtllm_prompt_cached_tokens_total{engine_type="undefined",model_name="m"} 416
# TYPE trtllm_prompt_cache_hit_tokens_total counter
trtllm_prompt_cache_hit_tokens_total{cache_level="0",cache_tier="gpu",engine_type="undefined",model_name="m"} 256
trtllm_prompt_cache_hit_tokens_total{cache_level="1",cache_tier="gpu",engine_type="undefined",model_name="m"} 32
trtllm_prompt_cache_hit_tokens_total{cache_level="2",cache_tier="host",engine_type="undefined",model_name="m"} 96
trtllm_prompt_cache_hit_tokens_total{cache_level="3",cache_tier="disk",engine_type="undefined",model_name="m"} 32
"""

VLLM_LMCACHE = """\
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="m"} 300
# TYPE vllm:prompt_tokens_cached_total counter
vllm:prompt_tokens_cached_total{model_name="m"} 160
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 96
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="external_unspecified"} 16
# TYPE lmcache:num_hit_tokens_total counter
lmcache:num_hit_tokens_total{model_name="m",worker_id="0"} 32
lmcache:num_hit_tokens_total{model_name="m",worker_id="1"} 32
"""

DYNAMO = """\
# TYPE dynamo_frontend_cached_tokens histogram
dynamo_frontend_cached_tokens_bucket{model="tiny",le="+Inf"} 3
dynamo_frontend_cached_tokens_sum{model="tiny"} 1408
dynamo_frontend_cached_tokens_count{model="tiny"} 3
# TYPE dynamo_frontend_input_sequence_tokens histogram
dynamo_frontend_input_sequence_tokens_bucket{model="tiny",le="+Inf"} 3
dynamo_frontend_input_sequence_tokens_sum{model="tiny"} 2217
dynamo_frontend_input_sequence_tokens_count{model="tiny"} 3
"""


def test_trtllm_levels_sum_into_their_tiers() -> None:
    totals = parse_totals(TRTLLM, "trtllm")
    assert totals is not None
    assert (totals.requests, totals.prompt_tokens, totals.cached_tokens) == (5, 900, 416)
    assert dict(totals.by_tier) == {"device": 288, "host": 96, "disk": 32}


def test_lmcache_hits_are_the_external_tier() -> None:
    totals = parse_totals(VLLM_LMCACHE, "vllm")
    assert totals is not None
    assert dict(totals.by_tier) == {"device": 96, "external": 64}


def test_dynamo_totals_are_the_frontend_histograms_sums() -> None:
    # Numbers seen on ai-dynamo 1.6.1's frontend over its mocker: 0, 704, 704 cached tokens.
    totals = parse_totals(DYNAMO, "dynamo")
    assert totals is not None
    assert (totals.requests, totals.prompt_tokens, totals.cached_tokens) == (3, 2217, 1408)
