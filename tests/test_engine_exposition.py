"""The engine's Prometheus text checked line by line before it is appended to the sidecar's (bytes in, bytes out)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics.merge import engine_exposition

VALID = (
    b"# HELP trtllm_prompt_cache_hit_tokens_total Prompt tokens served from each KV cache level.\n"
    b"# TYPE trtllm_prompt_cache_hit_tokens_total counter\n"
    b'trtllm_prompt_cache_hit_tokens_total{cache_level="0",cache_tier="gpu",note="a } b"} 42.0\n'
    b"\n"
    b"vllm:num_requests_running 0 1700000000000\n"
    b"nan_gauge NaN\n"
    b"inf_gauge +Inf"
)


def test_a_valid_exposition_is_kept_whole_with_a_final_newline() -> None:
    merged = engine_exposition(VALID)
    assert merged == VALID + b"\n"
    names = {family.name for family in text_string_to_metric_families(merged.decode())}
    assert {"trtllm_prompt_cache_hit_tokens", "vllm:num_requests_running"} <= names


@pytest.mark.parametrize(
    "body",
    [
        b'[{"iter": 3}]',
        b'{"status": "ok"}',
        b"<!doctype html>\n<html></html>",
        VALID + b"\nengine_up\n",  # a name without a value
        VALID + b"\nengine_up 1 2 3\n",  # three fields after the name
        VALID + b'\nengine_up{a="b" 1\n',  # labels never closed
        VALID + b"\nengine up 1\n",  # not a number where the value goes
        VALID + b"\n9lives 1\n",  # a name cannot start with a digit
        VALID + b"\nengine-up 1\n",  # nor hold a dash
    ],
)
def test_a_body_with_one_line_that_is_no_sample_or_comment_is_refused(body: bytes) -> None:
    assert engine_exposition(body) is None


def test_eof_unit_and_our_own_families_are_dropped() -> None:
    body = (
        b"# UNIT engine_queue_depth requests\n"
        b"engine_queue_depth 3\n"
        b"# TYPE cachewitness_requests_total counter\n"
        b"cachewitness_requests_total 9\n"
        b"# EOF"
    )
    assert engine_exposition(body) == b"engine_queue_depth 3\n"
