"""Verified resets against real engines: the canary proves or contradicts each reset (docs/reset.md)."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.real.conftest import Pair
from tests.real.sidecar_client import cache_state, complete, long_prompt, new_case, reset
from tests.support.client import CLIENT_TIMEOUT

MODEL = "tiny"


async def _earlier_traffic(s: aiohttp.ClientSession, pair: Pair) -> None:
    """Two different prompts through the sidecar: the engine's cache holds something to clear."""
    for _ in range(2):
        await complete(
            s, pair.url, {"model": MODEL, "prompt": long_prompt(), "max_tokens": 4, "temperature": 0}
        )


def _assert_verified(status: int, answer: dict[str, Any]) -> None:
    """A reset the canary proved: cached before, cold on both probes after."""
    assert status == 200 and answer["answer"] == "acknowledged" and answer["success"] is True, answer
    assert answer["verified"] == "verified", answer["verification"]
    verification = answer["verification"]
    assert verification["before"]["cached"] > 0
    assert [reading["cached"] for reading in verification["after"]] == [0, 0]
    assert answer["cache_state"]["verified"] == "verified"
    assert "ran cold after it" in answer["cache_state"]["reason"]


async def test_llamacpp_with_cache_ram_0_is_verified(llama: Pair) -> None:
    session_id, case_id = new_case()
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        await _earlier_traffic(s, llama)
        status, answer = await reset(s, llama.url, session_id=session_id, case_id=case_id)
    _assert_verified(status, answer)


async def test_llamacpp_canary_is_sized_by_its_tokenizer(llama: Pair) -> None:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        status, answer = await reset(s, llama.url)
    _assert_verified(status, answer)
    # No block size from llama-server: 512 of its tokens (the byte-level tiny model's bytes) and the
    # chat template, not 512 words (2,560 tokens).
    counts = [c for c in answer["calls"] if c["url"].endswith("/tokenize")]
    assert counts and all(c["status"] == 200 for c in counts), counts
    assert 512 <= answer["verification"]["canary_tokens"] < 512 + 64, answer["verification"]


async def test_llamacpp_default_ram_cache_after_traffic_is_contradicted(llama_ram_cache: Pair) -> None:
    pair = llama_ram_cache
    session_id, case_id = new_case()
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        await _earlier_traffic(s, pair)
        status, answer = await reset(s, pair.url, session_id=session_id, case_id=case_id)
        state = await cache_state(s, pair.url)
    assert status == 502, answer
    assert answer["answer"] == "contradicted" and answer["success"] is False
    assert answer["verified"] == "contradicted" and "--cache-ram 0" in answer["hint"]
    assert any(reading["cached"] > 0 for reading in answer["verification"]["after"]), answer["verification"]
    record = answer["cache_state"]
    assert record["reset"]["answer"] == "acknowledged" and record["verified"] == "contradicted"
    assert "was still cached after it" in record["reason"]
    assert state["verified"] == "contradicted"


async def test_vllm_dev_mode_is_verified_with_its_block_size(vllm: Pair) -> None:
    session_id, case_id = new_case()
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        await _earlier_traffic(s, vllm)
        status, answer = await reset(s, vllm.url, session_id=session_id, case_id=case_id)
    _assert_verified(status, answer)
    # The words span two of vLLM's CPU blocks (128 tokens) in its own tokens, and no third one:
    # 256 + the chat template (19 tokens on the tiny model) + at most one word (5 bytes). Sized
    # by words the canary was 1,298 tokens. Block-granular hits on the repeat.
    before = answer["verification"]["before"]
    assert 256 <= answer["verification"]["canary_tokens"] < 3 * 128, answer["verification"]
    assert before["cached"] % 128 == 0, before
    counts = [c for c in answer["calls"] if c["url"].endswith("/tokenize")]
    assert counts and all(c["status"] == 200 for c in counts), counts
