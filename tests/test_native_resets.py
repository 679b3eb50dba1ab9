"""The engines' own reset routes through the sidecar (issue 14): intercepted, answered in the engine's
shape, recorded with `via: "native"`; `native_resets` picks the engine's semantics or the uniform reset."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.app import build_app
from proxy.sim import SimConfig
from tests.conftest import make_settings, serve_app
from tests.sim_helpers import Sim, chat, fast, sim, slow, words

TOKEN = "admin-t0ken-for-native-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TAGS = {"X-Session-Id": "run-7", "X-Case-Id": "case-3"}
NATIVE = {
    "vllm": ("POST", "/reset_prefix_cache"),
    "sglang": ("POST", "/flush_cache"),
    "mindnano": ("POST", "/v1/cache/clear"),
}


@dataclass
class Stack:
    """A simulator and a sidecar in front of it (token set), with a client."""

    engine: Sim
    url: str
    http: aiohttp.ClientSession
    evidence: Path

    async def native(
        self, dialect: str, query: str = "", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes, aiohttp.typedefs.LooseHeaders]:
        """The engine's reset route through the sidecar, with the token and the case tags."""
        method, path = NATIVE[dialect]
        sent = {**AUTH, **TAGS, **(headers or {})}
        async with self.http.request(method, f"{self.url}{path}{query}", headers=sent) as resp:
            return resp.status, await resp.read(), resp.headers

    async def direct(self, dialect: str, query: str = "") -> tuple[int, bytes]:
        """The same route on the engine itself."""
        method, path = NATIVE[dialect]
        async with self.http.request(method, f"{self.engine.url}{path}{query}") as resp:
            return resp.status, await resp.read()

    async def stream(self, max_tokens: int) -> int:
        """A chat completion through the sidecar, read to the end; its status."""
        body = chat(words(8, "busy"), max_tokens)
        async with self.http.post(f"{self.url}/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status

    def records(self, event_type: str) -> list[dict[str, Any]]:
        """Evidence records of one type (read once the sidecar has stopped and flushed)."""
        lines = self.evidence.read_bytes().splitlines()
        return [r for r in map(orjson.loads, lines) if r["event_type"] == event_type]


@asynccontextmanager
async def stack(config: SimConfig, tmp_path: Path, **overrides: Any) -> AsyncIterator[Stack]:
    async with sim(config) as engine:
        settings = make_settings(engine.url, tmp_path, admin_token=TOKEN, engine=config.dialect, **overrides)
        async with serve_app(build_app(settings)) as url, aiohttp.ClientSession() as http:
            yield Stack(engine, url, http, tmp_path / "evidence" / "cachewitness.jsonl")


# -- native_resets = "uniform" ------------------------------------------------------------------


async def test_uniform_native_reset_drains_a_running_stream_first(tmp_path) -> None:
    async with stack(slow("vllm"), tmp_path, native_resets="uniform") as s:
        running = asyncio.create_task(s.stream(max_tokens=60))
        await s.engine.wait_stats(lambda st: st["running"] == 1)
        status, body, headers = await s.native("vllm")
        assert await running == 200
        assert (status, orjson.loads(body)) == (200, {"success": True})
        assert headers["X-Cachewitness-Answer"] == "acknowledged"
    (state,) = s.records("infer.cache_state")
    (observation,) = s.records("infer.cache_observation")
    assert state["via"] == "native" and (state["session_id"], state["case_id"]) == ("run-7", "case-3")
    assert state["reset"]["attempts"] == 1 and state["acknowledged"] is True
    assert state["reset_id"] == headers["X-Cachewitness-Reset-Id"]
    assert state["reset"]["at_ns"] >= observation["finished_ns"]


async def test_uniform_native_reset_retries_refusals(tmp_path) -> None:
    async with stack(slow("mindnano"), tmp_path, native_resets="uniform", drain=False) as s:
        running = asyncio.create_task(s.stream(max_tokens=40))
        await s.engine.wait_stats(lambda st: st["running"] == 1)
        status, body, _ = await s.native("mindnano")
        assert await running == 200
        assert status == 200 and orjson.loads(body) == {"cleared": True}
    (state,) = s.records("infer.cache_state")
    assert state["via"] == "native" and state["reset"]["attempts"] > 1 and state["acknowledged"] is True


async def test_uniform_sglang_flush_answers_in_sglangs_words(tmp_path) -> None:
    async with stack(slow("sglang"), tmp_path, native_resets="uniform", drain=False) as s:
        running = asyncio.create_task(s.stream(max_tokens=40))
        await s.engine.wait_stats(lambda st: st["running"] == 1)
        status, body, headers = await s.native("sglang", query="?timeout=10")
        assert await running == 200
    assert status == 200 and body.startswith(b"Cache flushed.")
    assert headers["Content-Type"].startswith("text/plain")
    (state,) = s.records("infer.cache_state")
    # SGLang's own timeout became the retry window, which the dialect passes back as ?timeout=.
    assert state["reset"]["url"].endswith("/flush_cache?timeout=10")


# -- native_resets = "engine" (the default) -------------------------------------------------------


@pytest.mark.parametrize("dialect", sorted(NATIVE))
async def test_engine_mode_gives_a_busy_engines_answer_exactly(dialect: str, tmp_path) -> None:
    # A long drain_timeout: were the native call drained, it would wait for the stream to end
    # and then succeed, which the engine's own answer did not.
    async with stack(slow(dialect), tmp_path, drain_timeout=600.0) as s:
        running = asyncio.create_task(s.stream(max_tokens=5000))
        await s.engine.wait_stats(lambda st: st["running"] == 1)
        expected = await s.direct(dialect)
        status, body, _ = await s.native(dialect)
        assert not running.done()  # no drain: the stream runs on
        running.cancel()
    assert expected[0] != 200 or b"false" in expected[1]  # the engine did refuse
    assert (status, body) == expected
    (state,) = s.records("infer.cache_state")
    assert state["via"] == "native" and state["reset"]["answer"] == "refused"
    assert state["reset"]["attempts"] == 1
    assert (state["session_id"], state["case_id"]) == ("run-7", "case-3")


@pytest.mark.parametrize("dialect", sorted(NATIVE))
async def test_engine_mode_on_an_idle_engine_is_acknowledged_and_recorded(dialect: str, tmp_path) -> None:
    async with stack(fast(dialect), tmp_path) as s:
        expected = await s.direct(dialect)
        status, body, _ = await s.native(dialect)
    assert (status, body) == expected and status == 200
    (state,) = s.records("infer.cache_state")
    assert state["via"] == "native" and state["acknowledged"] is True


async def test_reset_running_requests_maps_to_force(tmp_path) -> None:
    async with stack(slow("vllm"), tmp_path) as s:
        running = asyncio.create_task(s.stream(max_tokens=5000))
        await s.engine.wait_stats(lambda st: st["running"] == 1)
        status, body, _ = await s.native("vllm", query="?reset_running_requests=true")
        running.cancel()
    assert (status, orjson.loads(body)) == (200, {"success": True})
    (state,) = s.records("infer.cache_state")
    assert "reset_running_requests=true" in state["reset"]["url"]


@pytest.mark.parametrize(
    ("dialect", "query", "param"),
    [
        ("vllm", "?reset_running_requests=maybe", "reset_running_requests"),
        ("vllm", "?reset_running_requests=true&reset_running_requests=false", "reset_running_requests"),
        ("sglang", "?timeout=-1", "timeout"),
        ("sglang", "?timeout=nan", "timeout"),
    ],
)
async def test_bad_native_parameters_are_400_naming_them(
    dialect: str, query: str, param: str, tmp_path
) -> None:
    async with stack(fast(dialect), tmp_path) as s:
        status, body, _ = await s.native(dialect, query=query)
    assert status == 400 and orjson.loads(body)["error"]["param"] == param


async def test_bad_session_header_is_400(tmp_path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        status, body, _ = await s.native("vllm", headers={"X-Session-Id": "bad id with spaces"})
    assert status == 400 and orjson.loads(body)["error"]["param"] == "X-Session-Id"


async def test_api_resets_are_recorded_via_api(tmp_path) -> None:
    async with stack(fast("vllm"), tmp_path) as s, s.http.post(f"{s.url}/cache/reset", headers=AUTH) as resp:
        assert resp.status == 200
    (state,) = s.records("infer.cache_state")
    assert state["via"] == "api"


# -- who may call them ----------------------------------------------------------------------------


async def test_native_reset_auth_accepts_the_engine_key_on_reset_routes_only(tmp_path) -> None:
    key = "engine-key-for-bench-tools"
    async with stack(
        fast("vllm"), tmp_path, upstream_api_key=key, native_reset_auth="upstream_api_key", admin_open=False
    ) as s:
        engine_key = {"Authorization": f"Bearer {key}"}
        async with s.http.post(f"{s.url}/reset_prefix_cache", headers=engine_key) as resp:
            assert (resp.status, await resp.json()) == (200, {"success": True})
        async with s.http.post(f"{s.url}/collective_rpc", headers=engine_key) as resp:
            assert resp.status == 401


async def test_the_engine_key_is_refused_without_native_reset_auth(tmp_path) -> None:
    key = "engine-key-for-bench-tools"
    async with stack(fast("vllm"), tmp_path, upstream_api_key=key) as s:
        async with s.http.post(
            f"{s.url}/reset_prefix_cache", headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            assert resp.status == 401


# -- llama.cpp slot erase -------------------------------------------------------------------------


async def test_llamacpp_slot_erase_is_forwarded_and_recorded(tmp_path) -> None:
    config = fast("llamacpp", slot_save_path=str(tmp_path / "slots"))
    async with stack(config, tmp_path) as s:
        async with s.http.post(f"{s.url}/slots/1?action=erase", headers={**AUTH, **TAGS}) as resp:
            status, body = resp.status, await resp.json()
        async with s.http.post(f"{s.url}/slots/1?action=erase", headers={"X-Session-Id": "x"}) as resp:
            assert resp.status == 401
    assert status == 200 and body["id_slot"] == 1 and "n_erased" in body
    (state,) = s.records("infer.cache_state")
    assert state["via"] == "native" and state["acknowledged"] is True
    assert state["route"] == "POST /slots/1?action=erase"
    assert (state["session_id"], state["case_id"]) == ("run-7", "case-3")
