"""The counter witness and engine events, on the simulator over real sockets (docs/evidence.md).

Traffic that goes straight to the engine's port is seen by the engine's own counters only: a
case's reconciliation finds it (`bypass`); a restart inside or before a case changes its verdict.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.engines.counters import Totals
from proxy.witnesses.counters import CaseVerdict, Sums, reconcile
from tests.support.capture import capturing
from tests.support.client import CLIENT_TIMEOUT
from tests.support.sidecar import Stack, free_port, serve_sidecar, stack
from tests.support.sim import POLL_S, WAIT_S, chat, fast, sim, words


async def _through(s: Stack, content: str) -> dict[str, Any]:
    """One chat through the sidecar."""
    async with s.http.post(f"{s.url}/v1/chat/completions", json=chat(content, 2)) as resp:
        assert resp.status == 200
        answer: dict[str, Any] = await resp.json()
        return answer


async def _straight(s: Stack, content: str) -> dict[str, Any]:
    """One chat straight to the engine's port: the sidecar never sees it."""
    status, body = await s.engine.post_json("/v1/chat/completions", chat(content, 2))
    assert status == 200
    answer: dict[str, Any] = body
    return answer


async def _reset(s: Stack) -> dict[str, Any]:
    """An accepted reset with a case id."""
    status, body = await s.reset({"case_id": "case-1", "session_id": "sess"})
    assert status == 200, body
    return body


async def _close(s: Stack, case_id: str = "case-1") -> tuple[int, dict[str, Any]]:
    """POST /cache/cases/{case_id}/close."""
    async with s.http.post(f"{s.url}/cache/cases/{case_id}/close") as resp:
        return resp.status, await resp.json()


async def _state(s: Stack) -> dict[str, Any]:
    """GET /cache/state."""
    async with s.http.get(f"{s.url}/cache/state") as resp:
        state: dict[str, Any] = await resp.json()
        return state


async def _records(s: Stack, event_type: str) -> list[dict[str, Any]]:
    """The sidecar's records of one type."""
    async with s.http.get(f"{s.url}/cache/evidence", params={"event_type": event_type}) as resp:
        assert resp.status == 200, await resp.text()
        return [orjson.loads(line) for line in (await resp.read()).splitlines() if line]


async def _wait_state(s: Stack, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll /cache/state until `predicate` holds (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    state = await _state(s)
    while not predicate(state):
        assert loop.time() < deadline, f"never reached; last state {state}"
        await asyncio.sleep(POLL_S)
        state = await _state(s)
    return state


def _kinds(state: dict[str, Any]) -> list[str]:
    """The engine events /cache/state lists."""
    return [event["kind"] for event in state["engine_events"]]


async def _metric(s: Stack, name: str) -> float:
    """One sample of the sidecar's /metrics."""
    async with s.http.get(f"{s.url}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_bypass_with_cached_tokens_contradicts_the_case(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        assert await _metric(s, "cachewitness_bypass_requests_total") == 0
        await _reset(s)
        await _through(s, words(40, "seen"))
        prompt = words(40, "unseen")
        await _straight(s, prompt)
        again = await _straight(s, prompt)
        hit = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert hit > 0
        status, record = await _close(s)
        assert status == 200, record
        assert record["event_type"] == "infer.cache_reconciliation"
        assert record["case_id"] == "case-1"
        assert record["observed"]["requests"] == 1
        assert record["canary"]["requests"] == 5  # C1, C1 again, C2, two probes
        assert record["bypass"] == {
            "requests": 2,
            "prompt_tokens": 2 * again["usage"]["prompt_tokens"],
            "cached_tokens": hit,
        }
        assert record["verdict"] == "contradicted"
        assert "did not see" in record["reason"]
        state = await _state(s)
        assert state["bypass"]["requests"] == 2
        assert state["verdict"] == "contradicted"
        assert await _metric(s, "cachewitness_bypass_requests_total") == 2
        assert [r["reset_id"] for r in await _records(s, "infer.cache_reconciliation")][-1] == record[
            "reset_id"
        ]


async def test_bypass_without_cached_tokens_is_inconclusive(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        await _reset(s)
        first = await _through(s, words(40, "seen"))
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        await _straight(s, words(40, "other"))
        _status, record = await _close(s)
        assert record["bypass"]["requests"] == 1
        assert record["bypass"]["cached_tokens"] == 0
        assert record["verdict"] == "inconclusive"
        state = await _state(s)
        assert state["verdict"] == "inconclusive"
        assert state["verdict_reason"] == record["reason"]


async def test_no_bypass_is_consistent_and_the_next_reset_closes_the_case(tmp_path: Path) -> None:
    async with stack(fast("sglang"), tmp_path) as s:
        await _reset(s)
        await _through(s, words(40, "seen"))
        await _through(s, words(40, "seen"))
        await _reset(s)  # the next reset ends the case before it
        records = await _records(s, "infer.cache_reconciliation")
        closed = [r for r in records if r["case_id"] == "case-1" and r["closed_by"] == "reset"]
        assert closed, records
        assert closed[-1]["bypass"] == {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
        assert closed[-1]["observed"]["requests"] == 2
        assert closed[-1]["verdict"] == "consistent"


async def test_close_of_another_case_is_404(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        await _reset(s)
        status, body = await _close(s, "not-this-one")
        assert status == 404
        assert body["error"]["code"] == "case_not_open"


async def test_idle_gap_ends_the_case(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path, case_idle_s=0.3) as s:
        await _reset(s)
        await _through(s, words(40, "seen"))
        state = await _wait_state(s, lambda st: st["reconciliation"] is not None)
        assert state["reconciliation"]["closed_by"] == "idle"
        assert state["bypass"]["requests"] == 0


async def test_restart_inside_a_case_is_inconclusive(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        await _reset(s)
        await _through(s, words(40, "seen"))
        status, _stats = await s.engine.post_json("/sim/restart", {})
        assert status == 200
        await _wait_state(s, lambda st: "restarted" in _kinds(st))
        await _through(s, words(40, "after"))
        _status, record = await _close(s)
        assert record["restarted"] is True
        assert record["bypass"] is None
        assert record["verdict"] == "inconclusive"
        assert "restarted inside the case" in record["reason"]
        events = await _records(s, "infer.engine_event")
        assert [e["kind"] for e in events] == ["restarted"]
        assert events[0]["seen_by"].startswith("a counter went down")
        assert await _metric(s, 'cachewitness_engine_events_total{kind="restarted"}') == 1


async def test_counter_reset_seen_only_at_the_case_end(tmp_path: Path) -> None:
    # The watcher polls rarely here: only the close's read sees the counters go down.
    async with stack(fast("vllm"), tmp_path, health_interval=600.0) as s:
        await _reset(s)
        await _through(s, words(40, "seen"))
        await s.engine.post_json("/sim/restart", {})
        _status, record = await _close(s)
        assert record["restarted"] is True
        assert record["verdict"] == "inconclusive"
        assert "a counter went down" in record["reason"]


async def test_restart_before_the_case_is_cold_by_restart(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        await _reset(s)
        await s.engine.post_json("/sim/restart", {})
        await _wait_state(s, lambda st: "restarted" in _kinds(st))
        await _through(s, words(40, "first"))
        _status, record = await _close(s)
        assert record["verdict"] == "cold_by_restart"


@pytest.mark.parametrize("dialect", ["vllm"])
async def test_sleep_and_wake_are_engine_events(tmp_path: Path, dialect: str) -> None:
    async with stack(fast(dialect), tmp_path) as s:
        await _reset(s)
        async with s.http.post(s.engine.url + "/sleep") as resp:
            assert resp.status == 200
        await _wait_state(s, lambda st: "slept" in _kinds(st))
        async with s.http.post(s.engine.url + "/wake_up") as resp:
            assert resp.status == 200
        state = await _wait_state(s, lambda st: "woke" in _kinds(st))
        assert _kinds(state)[-2:] == ["slept", "woke"]


async def test_an_engine_gone_and_back_is_recorded(tmp_path: Path) -> None:
    # The sidecar reaches the engine through a hop on a fixed port: closing the hop takes the
    # engine away, opening it again on the same port brings it back.
    port = free_port()
    async with (
        sim(fast("vllm")) as engine,
        serve_sidecar(f"http://127.0.0.1:{port}", tmp_path) as side,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        s = Stack(engine, side.url, side.app, http)
        async with capturing(engine.url, port=port):
            await _reset(s)
            assert _kinds(await _state(s)) == []
        state = await _wait_state(s, lambda st: "unreachable" in _kinds(st))
        async with capturing(engine.url, port=port):
            state = await _wait_state(s, lambda st: "back" in _kinds(st))
        assert _kinds(state) == ["unreachable", "back"]
        records = await _records(s, "infer.engine_event")
        assert [(r["kind"], r["case_id"], r["seen_by"]) for r in records] == [
            ("unreachable", "case-1", "its /metrics"),
            ("back", "case-1", "its /metrics"),
        ]
        assert await _metric(s, 'cachewitness_engine_events_total{kind="unreachable"}') == 1
        assert await _metric(s, 'cachewitness_engine_events_total{kind="back"}') == 1


async def test_the_reset_window_is_only_the_canary(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        body = await _reset(s)
        counters = body["verification"]["witnesses"]["counters"]
        assert counters["result"] == "consistent", counters
        assert body["verification"]["witnesses"]["canary"]["result"] == "verified"
        assert counters["engine"]["requests"] == counters["canary"]["requests"] == 5
        assert counters["bypass"] == {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
        [state] = await _records(s, "infer.cache_state")
        assert state["verification"]["witnesses"]["counters"]["result"] == "consistent"


async def test_traffic_straight_to_the_engine_during_the_reset_contradicts_its_counters(
    tmp_path: Path,
) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        prompt = words(40, "sneak")
        stop = asyncio.Event()
        sent = 0

        async def sneak() -> None:
            nonlocal sent
            while not stop.is_set() and sent < 5000:
                await _straight(s, prompt)
                sent += 1

        task = asyncio.create_task(sneak())
        try:
            body = await _reset(s)
        finally:
            stop.set()
            await task
        counters = body["verification"]["witnesses"]["counters"]
        assert counters["result"] == "contradicted", counters
        assert counters["bypass"]["requests"] > 0 and counters["bypass"]["cached_tokens"] > 0
        assert body["verified"] == "verified"  # the canary's own prompts ran cold: the counters only say so


def test_counters_that_lag_a_request_in_flight_are_inconclusive_not_consistent() -> None:
    # The sidecar saw 2 requests reach the engine; the engine has counted 1 so far (the other is
    # still running at the read): nothing can be said about a bypass yet.
    _engine, bypass, restarted, verdict, reason = reconcile(
        Totals(10, 1000, 0),
        Totals(11, 1100, 0),
        seen=Sums(2, 200, 0),
        canary=Sums(),
        in_flight_at_read=1,
        restart_seen=None,
        restart_before_traffic=False,
    )
    assert bypass == {"requests": -1, "prompt_tokens": -100, "cached_tokens": 0} and not restarted
    assert verdict == CaseVerdict.INCONCLUSIVE, reason
    assert "1 requests in flight" in reason
