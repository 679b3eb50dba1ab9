"""What every real engine must show through the sidecar: one test each, run against llama.cpp and vLLM."""

from __future__ import annotations

import aiohttp
import pytest

from tests.real.conftest import Pair
from tests.real.sidecar_client import (
    JSON,
    cache_state,
    chunk_shapes,
    complete,
    find_key,
    long_prompt,
    new_case,
    observations,
    reset,
    stream,
    tags,
    verification,
)
from tests.support.client import CLIENT_TIMEOUT

MODEL = "tiny"
# The path each engine streams on in these tests: llama.cpp's chat template is built in;
# the tiny vLLM model has none, so it streams completions.
STREAM_PATH = {"llama": "/v1/chat/completions", "vllm": "/v1/completions"}


@pytest.fixture(params=["llama", "vllm"])
def engine(request: pytest.FixtureRequest) -> tuple[str, Pair]:
    """Each real engine behind its sidecar (session-scoped pairs, started once)."""
    return request.param, request.getfixturevalue(request.param)


def _body(kind: str) -> JSON:
    """A short deterministic request with a fresh long prompt, in the shape of the engine's stream path."""
    if STREAM_PATH[kind].endswith("chat/completions"):
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": long_prompt()}],
            "max_tokens": 8,
            "temperature": 0,
        }
    return {"model": MODEL, "prompt": long_prompt(), "max_tokens": 8, "temperature": 0}


async def test_repeated_prompt_is_cold_after_reset_then_cached(engine: tuple[str, Pair]) -> None:
    """After a reset the first request shows 0 cached tokens, the same prompt again > 0, and the verdict agrees."""
    _, pair = engine
    session_id, case_id = new_case()
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 8, "temperature": 0}
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        status, answer = await reset(s, pair.url, session_id=session_id, case_id=case_id)
        assert status == 200, answer
        first = await complete(s, pair.url, body, tags(session_id, case_id))
        second = await complete(s, pair.url, body, tags(session_id, case_id))
        records = await observations(s, pair.url, case_id, 2)
        verdict = await verification(s, pair.url, answer["reset_id"])
        state = await cache_state(s, pair.url)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached > 0
    assert [r["cached_tokens"] for r in records] == [0, cached]
    assert [r["ordinal_since_reset"] for r in records] == [1, 2]
    assert {r["reset_id"] for r in records} == {answer["reset_id"]}
    assert all(r["session_id"] == session_id and r["stream"] is False for r in records)
    assert verdict["verdict"] == "consistent", verdict
    assert "consistent" in find_key(state, "verdict"), state


async def test_streamed_repeat_is_cold_then_cached(engine: tuple[str, Pair]) -> None:
    """Streams are observed (injected usage, or llama.cpp's own timings): 0 cached tokens, then > 0."""
    kind, pair = engine
    session_id, case_id = new_case()
    body = _body(kind)
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        status, answer = await reset(s, pair.url, session_id=session_id, case_id=case_id)
        assert status == 200, answer
        first = await stream(s, pair.url, body, tags(session_id, case_id), path=STREAM_PATH[kind])
        second = await stream(s, pair.url, body, tags(session_id, case_id), path=STREAM_PATH[kind])
        records = await observations(s, pair.url, case_id, 2)
    assert first.done and second.done
    assert [r["stream"] for r in records] == [True, True]
    assert records[0]["cached_tokens"] == 0
    assert records[1]["cached_tokens"] > 0
    assert [r["ordinal_since_reset"] for r in records] == [1, 2]


async def test_stream_reaches_the_client_without_the_injected_usage(engine: tuple[str, Pair]) -> None:
    """The client's stream has the engine's own chunk shapes: no usage chunk added, no `usage: null`."""
    kind, pair = engine
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        direct = await stream(s, pair.engine_url, _body(kind), path=STREAM_PATH[kind])
        seen = await stream(s, pair.url, _body(kind), path=STREAM_PATH[kind])
    assert not any("usage" in e for e in direct.events)  # neither engine sends usage unasked
    assert seen.done
    assert all(e.get("choices") for e in seen.events), "a usage-only chunk reached the client"
    assert chunk_shapes(seen.events) == chunk_shapes(direct.events)
