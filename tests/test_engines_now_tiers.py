"""Cached tokens per tier from every engine that counts them (docs/engines.md, docs/evidence.md).

SGLang names them per request in `sglext.cached_tokens_details` (asked with
`return_cached_tokens_details`) and on `sglang:cached_tokens_total{cache_source}`; vLLM on
`prompt_tokens_cached_by_source`, else `prompt_tokens_by_source`, and per request where its
usage splits local from external hits. Observations carry `cached_by_tier` where the engine
says, null where it does not.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.engines.counters import parse_totals
from proxy.observe import usage_from_json
from tests.support.sidecar import Stack, stack
from tests.support.sim import WAIT_S, chat, fast, words


async def _observations(s: Stack, n: int) -> list[dict[str, Any]]:
    """The sidecar's first `n` observation records, once it has written them (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        async with s.http.get(
            f"{s.url}/cache/evidence", params={"event_type": "infer.cache_observation"}
        ) as r:
            records = [orjson.loads(line) for line in (await r.read()).splitlines() if line]
        if len(records) >= n or loop.time() > deadline:
            return records
        await asyncio.sleep(0.05)


async def test_sglang_tiers_name_a_warm_storage_tier(tmp_path: Path) -> None:
    config = fast("sglang", tier_details=True, hicache_storage_backend="mooncake")
    async with stack(config, tmp_path, clear_storage_tier=False) as s:
        status, body = await s.reset()
        assert status == 502 and body["answer"] == "contradicted", body
        verification = body["verification"]
        assert verification["tiers"]["external"] == "warm"
        assert verification["tiers"]["device"] == "cleared"
        hits = verification["probe_cached_by_tier"]
        assert hits["external"] > 0 and hits["device"] == 0, hits


async def test_observations_carry_sglangs_tiers_and_null_where_unnamed(tmp_path: Path) -> None:
    async with stack(fast("sglang", tier_details=True), tmp_path) as s:
        prompt = words(80, "tiered")
        asks: tuple[tuple[str, dict[str, Any]], ...] = (
            ("unasked", {}),
            ("tiered", {"return_cached_tokens_details": True}),
        )
        for word, extra in (*asks, asks[1]):
            async with s.http.post(
                f"{s.url}/v1/chat/completions", json=chat(words(80, word), 2, **extra)
            ) as r:
                assert r.status == 200
                await r.read()
        body = chat(prompt, 2, return_cached_tokens_details=True, stream=True)
        async with s.http.post(f"{s.url}/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.read()
        records = await _observations(s, 4)
        tiers = [record["cached_by_tier"] for record in records]
        assert tiers[0] is None  # not asked: the engine did not say, so not 0 either
        assert tiers[1] == {"device": 0, "host": 0, "external": 0}
        assert tiers[2]["device"] > 0 and tiers[2]["device"] == records[2]["cached_tokens"]
        assert tiers[3]["device"] == records[3]["cached_tokens"] > 0  # a stream's too


def test_usage_reads_sglext_and_vllms_local_external_split() -> None:
    sglang = {
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 6}},
        "sglext": {
            "cached_tokens_details": {"device": 4, "host": 1, "storage": 1, "storage_backend": "file"}
        },
    }
    assert usage_from_json(orjson.dumps(sglang)).cached_by_tier == {"device": 4, "host": 1, "disk": 1}
    details = {"cached_tokens": 9, "local_cached_tokens": 5, "external_cached_tokens": 4}
    vllm = {"usage": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": details}}
    assert usage_from_json(orjson.dumps(vllm)).cached_by_tier == {"device": 5, "external": 4}
    plain = {
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 9}}
    }
    assert usage_from_json(orjson.dumps(plain)).cached_by_tier is None


SGLANG_TIERED = (
    'sglang:cached_tokens_total{model_name="m",cache_source="device"} 30\n'
    'sglang:cached_tokens_total{model_name="m",cache_source="storage"} 12\n'
    'sglang:prompt_tokens_total{model_name="m"} 100\n'
)
VLLM_BY_SOURCE = (
    'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 70\n'
    'vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 20\n'
    'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 10\n'
    'vllm:prompt_tokens_total{engine="0"} 100\n'
)


@pytest.mark.parametrize(
    ("text", "kind", "by_tier"),
    [
        (SGLANG_TIERED, "sglang", {"device": 30, "storage": 12}),
        (VLLM_BY_SOURCE, "vllm", {"device": 20, "external": 10}),
    ],
)
def test_per_tier_counters_of_sglang_and_vllms_older_family(
    text: str, kind: str, by_tier: dict[str, int]
) -> None:
    totals = parse_totals(text, kind)
    assert totals is not None and totals.by_tier == by_tier
