"""The engines' own reset routes through the sidecar (issue 14): intercepted, answered in the engine's
shape, recorded with `via: "native"`; `native_resets` picks the engine's semantics or the uniform reset."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from multidict import CIMultiDictProxy

from proxy.sim import SimConfig
from tests.support.evidence_files import evidence_records
from tests.support.sidecar import Stack, running_request, stack
from tests.support.sim import fast, slow

TOKEN = "admin-t0ken-for-native-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TAGS = {"X-Session-Id": "run-7", "X-Case-Id": "case-3"}
NATIVE = {
    "vllm": ("POST", "/reset_prefix_cache"),
    "sglang": ("POST", "/flush_cache"),
    "mindnano": ("POST", "/v1/cache/clear"),
    "trtllm": ("POST", "/reset_prefix_cache"),
    "dynamo": ("POST", "/clear_kv_blocks"),
}


async def native(
    s: Stack, dialect: str, query: str = "", headers: dict[str, str] | None = None
) -> tuple[int, bytes, CIMultiDictProxy[str]]:
    """The engine's reset route through the sidecar, with the token and the case tags."""
    method, path = NATIVE[dialect]
    sent = {**AUTH, **TAGS, **(headers or {})}
    async with s.http.request(method, f"{s.url}{path}{query}", headers=sent) as resp:
        return resp.status, await resp.read(), resp.headers


async def direct(s: Stack, dialect: str) -> tuple[int, bytes]:
    """The same route on the engine itself."""
    method, path = NATIVE[dialect]
    async with s.http.request(method, f"{s.engine.url}{path}") as resp:
        return resp.status, await resp.read()


def records(tmp_path: Path, event_type: str) -> list[dict[str, Any]]:
    """Evidence records of one type (read once the sidecar has stopped and flushed)."""
    records = evidence_records(tmp_path / "evidence" / "cachewitness.jsonl")
    return [r for r in records if r["event_type"] == event_type]


@asynccontextmanager
async def sidecar(config: SimConfig, tmp_path: Path, **overrides: Any) -> AsyncIterator[Stack]:
    """The shared stack with the admin token set and the engine named (no detection race)."""
    async with stack(config, tmp_path, admin_token=TOKEN, engine=config.dialect, **overrides) as s:
        yield s


# -- native_resets = "uniform" ------------------------------------------------------------------


async def test_uniform_native_reset_drains_a_running_stream_first(tmp_path: Path) -> None:
    async with sidecar(slow("vllm"), tmp_path, native_resets="uniform") as s:
        async with running_request(s, max_tokens=60) as running:
            status, body, headers = await native(s, "vllm")
            assert await running == 200
        assert (status, orjson.loads(body)) == (200, {"success": True})
        assert headers["X-Cachewitness-Answer"] == "acknowledged"
    (state,) = records(tmp_path, "infer.cache_state")
    (observation,) = records(tmp_path, "infer.cache_observation")
    assert state["via"] == "native" and (state["session_id"], state["case_id"]) == ("run-7", "case-3")
    assert state["reset"]["attempts"] == 1 and state["acknowledged"] is True
    assert state["reset_id"] == headers["X-Cachewitness-Reset-Id"]
    assert state["reset"]["at_ns"] >= observation["finished_ns"]


async def test_uniform_native_reset_retries_refusals(tmp_path: Path) -> None:
    async with sidecar(slow("mindnano"), tmp_path, native_resets="uniform", drain=False) as s:
        async with running_request(s, max_tokens=40) as running:
            status, body, _ = await native(s, "mindnano")
            assert await running == 200
        assert status == 200 and orjson.loads(body) == {"cleared": True}
    (state,) = records(tmp_path, "infer.cache_state")
    assert state["via"] == "native" and state["reset"]["attempts"] > 1 and state["acknowledged"] is True


async def test_uniform_sglang_flush_answers_in_sglangs_words(tmp_path: Path) -> None:
    async with sidecar(slow("sglang"), tmp_path, native_resets="uniform", drain=False) as s:
        async with running_request(s, max_tokens=40) as running:
            status, body, headers = await native(s, "sglang", query="?timeout=10")
            assert await running == 200
    assert status == 200 and body.startswith(b"Cache flushed.")
    assert headers["Content-Type"].startswith("text/plain")
    (state,) = records(tmp_path, "infer.cache_state")
    # SGLang's own timeout became the retry window, which the dialect passes back as ?timeout=.
    assert state["reset"]["url"].endswith("/flush_cache?timeout=10")


# -- native_resets = "engine" (the default) -------------------------------------------------------


@pytest.mark.parametrize("dialect", sorted(NATIVE))
async def test_engine_mode_gives_a_busy_engines_answer_exactly(dialect: str, tmp_path: Path) -> None:
    # A long drain_timeout: were the native call drained, it would wait for the stream to end
    # and then succeed, which the engine's own answer did not.
    async with sidecar(slow(dialect), tmp_path, drain_timeout=600.0) as s, running_request(s) as running:
        expected = await direct(s, dialect)
        status, body, _ = await native(s, dialect)
        assert not running.done()  # no drain: the stream runs on
    # The engine did refuse (Dynamo: its worker's "status":"error" inside a 200).
    assert expected[0] != 200 or b"false" in expected[1] or b'\\"status\\":\\"error\\"' in expected[1]
    assert (status, body) == expected
    (state,) = records(tmp_path, "infer.cache_state")
    assert state["via"] == "native" and state["reset"]["answer"] == "refused"
    assert state["reset"]["attempts"] == 1
    assert (state["session_id"], state["case_id"]) == ("run-7", "case-3")


@pytest.mark.parametrize("dialect", sorted(NATIVE))
async def test_engine_mode_on_an_idle_engine_is_acknowledged_and_recorded(
    dialect: str, tmp_path: Path
) -> None:
    async with sidecar(fast(dialect), tmp_path) as s:
        expected = await direct(s, dialect)
        status, body, _ = await native(s, dialect)
    assert (status, body) == expected and status == 200
    (state,) = records(tmp_path, "infer.cache_state")
    assert state["via"] == "native" and state["acknowledged"] is True


async def test_reset_running_requests_maps_to_force(tmp_path: Path) -> None:
    async with sidecar(slow("vllm"), tmp_path) as s, running_request(s):
        status, body, _ = await native(s, "vllm", query="?reset_running_requests=true")
    assert (status, orjson.loads(body)) == (200, {"success": True})
    (state,) = records(tmp_path, "infer.cache_state")
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
    dialect: str, query: str, param: str, tmp_path: Path
) -> None:
    async with sidecar(fast(dialect), tmp_path) as s:
        status, body, _ = await native(s, dialect, query=query)
    assert status == 400 and orjson.loads(body)["error"]["param"] == param


async def test_bad_session_header_is_400(tmp_path: Path) -> None:
    async with sidecar(fast("vllm"), tmp_path) as s:
        status, body, _ = await native(s, "vllm", headers={"X-Session-Id": "bad id with spaces"})
    assert status == 400 and orjson.loads(body)["error"]["param"] == "X-Session-Id"


async def test_api_resets_are_recorded_via_api(tmp_path: Path) -> None:
    async with (
        sidecar(fast("vllm"), tmp_path) as s,
        s.http.post(f"{s.url}/cache/reset", headers=AUTH) as resp,
    ):
        assert resp.status == 200
    (state,) = records(tmp_path, "infer.cache_state")
    assert state["via"] == "api"


# -- who may call them ----------------------------------------------------------------------------


async def test_native_reset_auth_accepts_the_engine_key_on_reset_routes_only(tmp_path: Path) -> None:
    key = "engine-key-for-bench-tools"
    async with sidecar(
        fast("vllm"), tmp_path, upstream_api_key=key, native_reset_auth="upstream_api_key", admin_open=False
    ) as s:
        engine_key = {"Authorization": f"Bearer {key}"}
        async with s.http.post(f"{s.url}/reset_prefix_cache", headers=engine_key) as resp:
            assert (resp.status, await resp.json()) == (200, {"success": True})
        async with s.http.post(f"{s.url}/collective_rpc", headers=engine_key) as resp:
            assert resp.status == 401


async def test_the_engine_key_is_refused_without_native_reset_auth(tmp_path: Path) -> None:
    key = "engine-key-for-bench-tools"
    async with (
        sidecar(fast("vllm"), tmp_path, upstream_api_key=key) as s,
        s.http.post(f"{s.url}/reset_prefix_cache", headers={"Authorization": f"Bearer {key}"}) as resp,
    ):
        assert resp.status == 401


# -- llama.cpp slot erase -------------------------------------------------------------------------


async def test_llamacpp_slot_erase_is_forwarded_and_recorded(tmp_path: Path) -> None:
    config = fast("llamacpp", slot_save_path=str(tmp_path / "slots"))
    async with sidecar(config, tmp_path) as s:
        async with s.http.post(f"{s.url}/slots/1?action=erase", headers={**AUTH, **TAGS}) as resp:
            status, body = resp.status, await resp.json()
        async with s.http.post(f"{s.url}/slots/1?action=erase", headers={"X-Session-Id": "x"}) as resp:
            assert resp.status == 401
    assert status == 200 and body["id_slot"] == 1 and "n_erased" in body
    (state,) = records(tmp_path, "infer.cache_state")
    assert state["via"] == "native" and state["acknowledged"] is True
    assert state["route"] == "POST /slots/1?action=erase"
    assert (state["session_id"], state["case_id"]) == ("run-7", "case-3")
