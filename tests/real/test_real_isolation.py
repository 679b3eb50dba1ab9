"""Isolation against real engines on the CPU: llama-server's `cache_prompt: false`, vLLM's `cache_salt`.

The same prompt three times isolated reports 0 cached tokens each time; not isolated, it is
cached from the second. With llama-server's host-RAM prompt cache on, a prompt that cache holds
serves a plain request warm and an isolated one cold. vLLM's counters over an isolated case
count no cached token beyond the reset's canary.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.real.conftest import Pair
from tests.real.sidecar_client import (
    REQUEST_TIMEOUT,
    complete,
    eventually,
    evidence,
    long_prompt,
    new_case,
    reset,
    tags,
)
from tests.support.client import CLIENT_TIMEOUT

MODEL = "tiny"
ISOLATED = {"X-Cachewitness-Isolation": "request"}


def _cached(answer: dict[str, Any]) -> int:
    """The cached tokens the engine reported."""
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def _body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}


async def test_isolated_requests_of_one_prompt_are_all_cold(llama: Pair) -> None:
    session_id, case_id = new_case()
    isolated = {**tags(session_id, case_id), **ISOLATED}
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        body = _body(long_prompt())
        cold = [_cached(await complete(s, llama.url, body, isolated)) for _ in range(3)]
        plain = _body(long_prompt())
        warm = [_cached(await complete(s, llama.url, plain, tags(session_id, "plain"))) for _ in range(2)]

        async def marks() -> list[Any] | None:
            found = [r["isolation"] for r in await evidence(s, llama.url, case_id=case_id)]
            return found if len(found) == 3 else None

        recorded = await eventually(marks, 10, "three observations")
    assert cold == [0, 0, 0]
    assert warm[0] == 0 and warm[1] > 0
    assert recorded == [{"mode": "request", "result": "cold", "field": "cache_prompt"}] * 3


async def test_the_host_ram_prompt_cache_does_not_serve_an_isolated_request(llama_ram_cache: Pair) -> None:
    pair = llama_ram_cache
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        # Control: a prompt moved from its slot into the RAM cache serves a plain request warm.
        first = _body(long_prompt())
        await complete(s, pair.url, first)
        await complete(s, pair.url, _body(long_prompt()))
        warm = _cached(await complete(s, pair.url, first))
        # The same steps, and the request isolated: nothing reused.
        second = _body(long_prompt())
        await complete(s, pair.url, second)
        await complete(s, pair.url, _body(long_prompt()))
        cold = _cached(await complete(s, pair.url, second, ISOLATED))
    assert warm > 0
    assert cold == 0


async def test_vllm_isolated_case_is_cold_and_its_counters_agree(vllm: Pair) -> None:
    session_id, case_id = new_case()
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        status, answer = await reset(s, vllm.url, session_id=session_id, case_id=case_id, isolation="request")
        assert status == 200 and answer["isolation"] == "request", answer
        body = _body(long_prompt())
        cold = [_cached(await complete(s, vllm.url, body, tags(session_id, case_id))) for _ in range(3)]
        async with s.post(f"{vllm.url}/cache/cases/{case_id}/close", timeout=REQUEST_TIMEOUT) as resp:
            assert resp.status == 200, await resp.text()
            closed = await resp.json()
        plain = _body(long_prompt())
        warm = [_cached(await complete(s, vllm.url, plain, tags(session_id, "plain"))) for _ in range(2)]
    assert cold == [0, 0, 0]
    assert warm[0] == 0 and warm[1] > 0
    [record] = closed["isolation"]
    assert (record["requests"], record["cold"], record["verdict"]) == (3, 3, "cold"), record
    # The engine's own counters over the case: no cached token beyond the canary's.
    assert record["counters"]["result"] == "cold", record
    assert record["counters"]["engine"]["requests"] >= 3, record
