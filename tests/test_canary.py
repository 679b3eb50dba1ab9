"""Verified resets: the canary inside the drain window, against each dialect of the simulator (docs/reset.md)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.sim import SimConfig
from tests.support.capture import Answer, Capture, capturing
from tests.support.cli import cli
from tests.support.cli import sidecar as client_sidecar
from tests.support.client import CLIENT_TIMEOUT
from tests.support.sidecar import Stack, serve_sidecar, stack
from tests.support.sim import chat, fast, sim, words

# Each dialect as a sidecar meets it: the simulator's options and the sidecar's.
DIALECTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "vllm": ("vllm", {}, {}),
    "sglang": ("sglang", {}, {}),
    "mindnano": ("mindnano", {}, {}),
    "llamacpp": ("llamacpp", {"slot_save_path": "."}, {}),
    # A generic engine with its reset route configured (here vLLM's, through the generic dialect).
    "generic": ("vllm", {}, {"engine": "generic", "reset_path": "/reset_prefix_cache"}),
}
CANARY_CALL_KEYS = {"canary", "cached", "prompt"}


def _dialect(name: str, **extra: Any) -> tuple[SimConfig, dict[str, Any]]:
    """The simulator config and sidecar settings of one DIALECTS entry."""
    kind, options, settings = DIALECTS[name]
    return fast(kind, **{**options, **extra}), settings


def _canary_calls(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The answer's calls that were canary requests, their excerpts decoded."""
    return [
        orjson.loads(call["body_excerpt"])
        for call in body["calls"]
        if call["url"].endswith("/chat/completions")
    ]


async def _metrics(s: Stack) -> str:
    """The sidecar's /metrics text."""
    async with s.http.get(f"{s.url}/metrics") as resp:
        return await resp.text()


async def _client_chat(s: Stack, content: str) -> dict[str, Any]:
    """One client request through the sidecar, tagged; its JSON answer."""
    async with s.http.post(
        f"{s.url}/v1/chat/completions",
        json=chat(content, 2),
        headers={"X-Session-Id": "s", "X-Case-Id": "c"},
    ) as resp:
        assert resp.status == 200
        answer: dict[str, Any] = await resp.json()
        return answer


async def _evidence(s: Stack, event_type: str) -> list[dict[str, Any]]:
    """The sidecar's evidence records of one type."""
    async with s.http.get(f"{s.url}/cache/evidence", params={"event_type": event_type}) as resp:
        return [orjson.loads(line) for line in (await resp.read()).splitlines()]


@pytest.mark.parametrize("name", list(DIALECTS))
async def test_canary_verifies_a_reset_that_clears_the_cache(tmp_path: Path, name: str) -> None:
    config, settings = _dialect(name)
    async with stack(config, tmp_path, **settings) as s:
        await _client_chat(s, words(40))  # earlier traffic
        status, body = await s.reset({"session_id": "s", "case_id": "c"})
    assert status == 200 and body["answer"] == "acknowledged" and body["success"] is True, body
    assert body["verified"] == "verified"
    verification = body["verification"]
    assert verification["method"] == "canary"
    assert verification["before"]["cached"] > 0
    assert [reading["cached"] for reading in verification["after"]] == [0, 0]
    assert verification["canary_tokens"] == verification["before"]["prompt"] > 0
    record = body["cache_state"]
    assert record["verified"] == "verified" and record["verification"] == verification
    before = verification["before"]
    assert record["reason"].startswith(
        f"a canary cached before the reset ({before['cached']} of {before['prompt']} prompt tokens) "
        "ran cold after it (0 of"
    ), record["reason"]
    # C1 twice and C2 before the reset, a probe of each after it. Mindnano has no tokenizer route
    # and counts characters: its first C1 (a token per word assumed) is far too long, sent again sized.
    resent = ["C1 resized"] if name == "mindnano" else []
    assert [call["canary"] for call in _canary_calls(body)] == [
        "C1",
        *resent,
        "C1 again",
        "C2",
        "C1 probe",
        "C2 probe",
    ]


async def test_llamacpp_ram_cache_contradicts_the_reset(tmp_path: Path) -> None:
    config, settings = _dialect("llamacpp", ram_cache=True)
    async with stack(config, tmp_path, **settings) as s:
        status, body = await s.reset({"session_id": "s", "case_id": "c"})
        state = await (await s.http.get(f"{s.url}/cache/state")).json()
    assert status == 502 and body["answer"] == "contradicted" and body["success"] is False, body
    assert body["verified"] == "contradicted" and "--cache-ram 0" in body["hint"]
    record = body["cache_state"]
    # The engine did acknowledge the erase; the canary shows it did not clear the cache.
    assert record["reset"]["answer"] == "acknowledged" and record["acknowledged"] is True
    assert record["verified"] == "contradicted" and record["run_kind"] == "unspecified"
    before, after = body["verification"]["before"], body["verification"]["after"]
    assert after[0]["cached"] > 0
    assert record["reason"] == (
        f"a canary cached before the reset ({before['cached']} of {before['prompt']} prompt tokens) "
        f"was still cached after it ({after[0]['cached']} of {after[0]['prompt']})"
    )
    assert state["verified"] == "contradicted" and state["last_reset"]["answer"] == "contradicted"


async def test_vllm_without_cached_token_details_is_unverified_and_names_the_flag(tmp_path: Path) -> None:
    async with stack(fast("vllm", prompt_tokens_details=False), tmp_path) as s:
        status, body = await s.reset()
    assert status == 200 and body["answer"] == "acknowledged"
    assert body["verified"] == "unverified"
    assert "--enable-prompt-tokens-details" in body["verification"]["reason"]
    assert "--enable-prompt-tokens-details" in body["cache_state"]["reason"]
    assert len(_canary_calls(body)) == 1  # one answer without the field is enough to know


async def test_canary_shorter_than_a_cache_block_is_unverified(tmp_path: Path) -> None:
    # A page beyond any engine's (70,000 tokens) is not believed, so the canary keeps its default
    # 512 words, which fit in no such block: the repeat cannot be cached.
    async with stack(fast("sglang", block_size=70_000), tmp_path) as s:
        _, body = await s.reset()
    assert body["verified"] == "unverified" and body["answer"] == "acknowledged"
    assert "repeat was not cached (0 of" in body["verification"]["reason"]


@pytest.mark.parametrize("name", list(DIALECTS))
async def test_first_client_request_after_a_verified_reset_is_cold(tmp_path: Path, name: str) -> None:
    config, settings = _dialect(name)
    async with stack(config, tmp_path, **settings) as s:
        _, body = await s.reset({"session_id": "s", "case_id": "c"})
        assert body["verified"] == "verified"
        # Short, so any canary token left in a slot would show (llama.cpp matches per token).
        answer = await _client_chat(s, "hello")
        [observation] = await _evidence(s, "infer.cache_observation")
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert observation["cached_tokens"] == 0 and observation["ordinal_since_reset"] == 1


async def test_canary_requests_are_not_client_traffic(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        _, body = await s.reset({"session_id": "s", "case_id": "c"})
        for content in ("one", "two"):
            await _client_chat(s, content)
        observations = await _evidence(s, "infer.cache_observation")
        text = await _metrics(s)
    assert body["verified"] == "verified"
    assert [o["ordinal_since_reset"] for o in observations] == [1, 2]  # the client's two, numbered from 1
    # Either server may take them (the session's connection served the reset: aiohttp's from then on).
    served = [
        f'cachewitness_requests_total{{code="2xx",route="/v1/chat/completions",served_by="{by}"}}'
        for by in ("front", "aiohttp")
    ]
    assert (
        sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(tuple(served)))
        == 2
    )
    assert 'cachewitness_canary_requests_total{outcome="ok"} 5.0' in text
    assert 'cachewitness_cache_resets_verified_total{verified="verified"} 1.0' in text


async def test_canary_prompts_and_completions_are_never_written(tmp_path: Path) -> None:
    async with stack(fast("mindnano"), tmp_path) as s:
        _, body = await s.reset({"session_id": "s", "case_id": "c"})
        [record] = await _evidence(s, "infer.cache_state")
    assert body["verified"] == "verified"
    assert all(set(call) == CANARY_CALL_KEYS for call in _canary_calls(body))
    assert record["reset_id"] == body["reset_id"]
    text = orjson.dumps([body, record]).decode()
    assert "cachewitness-canary-" not in text  # mindnano's canary `user`
    assert '"content"' not in text and '"messages"' not in text


async def test_verify_none_sends_no_canary(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        status, body = await s.reset({"verify": "none"})
        stats = await s.engine.stats()
    assert status == 200 and body["answer"] == "acknowledged"
    assert body["verified"] == "unverified" and body["verification"]["method"] == "none"
    assert stats["requests_total"] == 0 and [c["url"].rsplit("/", 1)[-1] for c in body["calls"]] == [
        "reset_prefix_cache?reset_external=true"
    ]
    assert body["cache_state"]["reason"] == (
        "the server acknowledged the cache reset, but no engine adapter can confirm it"
    )


async def test_config_verify_sets_the_default_and_input_overrides_it(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path, verify="none") as s:
        _, by_default = await s.reset()
        _, asked = await s.reset({"verify": "canary"})
    assert by_default["verification"]["method"] == "none"
    assert asked["verified"] == "verified"


async def test_bad_verify_is_rejected_with_the_field_named(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        status, body = await s.reset({"verify": "maybe"})
    assert status == 400 and body["error"]["param"] == "verify"


async def test_reset_without_drain_sends_no_canary_and_says_why(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        _, body = await s.reset({"drain": False})
    assert body["verified"] == "unverified" and "drain" in body["verification"]["reason"]
    assert _canary_calls(body) == []


async def test_concurrent_first_requests_are_inconclusive_never_contradicted(tmp_path: Path) -> None:
    # One request runs at a time and the waiting one with the lowest `priority` goes first,
    # so the engine can run the sidecar's second request before its first.
    config = SimConfig(
        dialect="vllm", decode_rate=100, prefill_rate=0, max_concurrency=1, scheduling_policy="priority"
    )
    shared = words(64, "shared")
    async with stack(config, tmp_path) as s:
        _, body = await s.reset({"session_id": "s", "case_id": "c"})
        assert body["verified"] == "verified"
        # A request straight to the engine holds its one running place.
        blocker = await s.http.post(
            f"{s.engine.url}/v1/chat/completions", json={**chat("block", 100000), "stream": True}
        )
        await s.engine.wait_stats(lambda st: st["running"] == 1)
        first = asyncio.create_task(
            s.http.post(f"{s.url}/v1/chat/completions", json={**chat(shared, 2), "priority": 1})
        )
        await s.engine.wait_stats(lambda st: st["waiting"] == 1)
        second = asyncio.create_task(
            s.http.post(f"{s.url}/v1/chat/completions", json={**chat(shared, 2), "priority": 0})
        )
        await s.engine.wait_stats(lambda st: st["waiting"] == 2)
        blocker.close()  # the engine aborts it; the second request runs, then the first
        answers = [await (await task).json() for task in (first, second)]
        [verification] = await _evidence(s, "infer.cache_verification")
        state = await (await s.http.get(f"{s.url}/cache/state")).json()
    assert answers[0]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the first ran second
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert verification["verdict"] == "inconclusive" and verification["request_id"]
    assert (state["verified"], state["verdict"]) == ("verified", "inconclusive")


async def test_cli_reset_exits_7_when_the_canary_contradicts_the_reset(tmp_path: Path) -> None:
    config = fast("llamacpp", slot_save_path=str(tmp_path), ram_cache=True)
    async with client_sidecar(config, tmp_path) as (_, url):
        run = await cli("reset", "--url", url)
    assert run.code == 7, run.stderr
    assert run.stdout.startswith("contradicted") and "--cache-ram 0" in run.stdout


@asynccontextmanager
async def _behind_a_hop(tmp_path: Path, answer: Answer | None = None) -> AsyncIterator[tuple[Stack, Capture]]:
    """A vLLM simulator, the capturing hop in front of it (answering what `answer` takes), the sidecar in front."""
    async with (
        sim(fast("vllm")) as engine,
        capturing(engine.url, answer=answer) as capture,
        serve_sidecar(capture.url, tmp_path, engine="vllm") as sidecar,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        yield Stack(engine, sidecar.url, sidecar.app, http), capture


async def test_each_reset_sends_the_engine_canaries_it_never_saw_before(tmp_path: Path) -> None:
    """Two resets' canaries share almost no words: a canary the engine could know is one a warm cache answers."""
    async with _behind_a_hop(tmp_path) as (s, capture):
        for _ in range(2):
            status, body = await s.reset({"retry_seconds": 0})
            assert status == 200 and body["verified"] == "verified", body
    prompts = [
        orjson.loads(seen.body)["messages"][-1]["content"]
        for seen in capture.seen
        if seen.raw_path == "/v1/chat/completions"
    ]
    # Each reset sends C1, C1 again, C2, and a probe of each: five canary requests, two texts.
    assert len(prompts) == 10, len(prompts)
    first, second = set(prompts[:5]), set(prompts[5:])
    assert len(first) == len(second) == 2
    words_before = {word for text in first for word in text.split()}
    words_after = {word for text in second for word in text.split()}
    # Random four-letter words (26**4 of them): two canaries' few dozen words share one at most, by chance.
    assert len(words_before & words_after) < len(words_after) // 10, sorted(words_before & words_after)


async def test_a_follow_up_reset_the_engine_refuses_leaves_the_reset_unverified(tmp_path: Path) -> None:
    """The engine takes the reset but not the resets after the probes: the canaries may still be
    cached for the benchmark's first request, so the cold probes prove nothing (unverified)."""
    resets = []

    def refuse_after_the_first(path: str, _body: bytes) -> web.Response | None:
        if path != "/reset_prefix_cache":
            return None
        resets.append(path)
        if len(resets) == 1:
            return None  # the simulator takes it
        return web.json_response({"error": "reset refused"}, status=500)

    async with _behind_a_hop(tmp_path, refuse_after_the_first) as (s, _):
        status, body = await s.reset({"retry_seconds": 0})
    assert len(resets) >= 3, resets  # the reset, and one after each probe
    assert status == 200 and body["answer"] == "acknowledged", body  # the reset itself was taken
    assert body["verified"] == "unverified", body
    verification = body["verification"]
    assert [reading["cached"] for reading in verification["after"]] == [0, 0]  # the probes ran cold
    assert "but a reset after the probes was not accepted" in verification["reason"], verification["reason"]
    assert "canary prompts may still be cached" in body["cache_state"]["reason"]
