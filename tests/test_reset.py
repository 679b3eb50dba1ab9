"""`POST /cache/reset` through the whole sidecar in front of the simulator (docs/reset.md, docs/evidence.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.admission import ADMISSION
from proxy.reset.retry import RESET_RETRY_INTERVAL_SECONDS
from proxy.reset.service import RESETS
from proxy.sim import SimConfig
from tests.support.client import CLIENT_TIMEOUT
from tests.support.evidence_files import evidence_records
from tests.support.sidecar import Stack, closed_port_url, running_request, serve_sidecar, stack
from tests.support.sim import WAIT_S, fast, slow, words

REFERENCE_RECORD_KEYS = {
    "schema_version",
    "event_type",
    "session_id",
    "case_id",
    "requested",
    "reset",
    "attempted",
    "acknowledged",
    "verified",
    "reason",
    "run_kind",
}
# A chat this long is still generating when any test's reset is done (100 tokens/s).
LONG_CHAT_TOKENS = 1000
# A chat still generating when a reset's first attempt reaches the engine, even on a loaded
# machine (3 s at 100 tokens/s), and done well within a 30 s retry window.
BUSY_CHAT_TOKENS = 300
REFERENCE_RESET_KEYS = {"url", "at_ns", "status", "error", "success", "answer", "attempts", "answered_at_ns"}


async def wait_until(predicate: Callable[[], bool]) -> None:
    """Poll a condition of the running app (bounded by WAIT_S)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not predicate():
        assert loop.time() < deadline, "the state was never reached"
        await asyncio.sleep(0.005)


async def reset_while_generating(
    s: Stack, body: dict[str, Any], max_tokens: int
) -> tuple[int, dict[str, Any]]:
    """Reset while one chat generates; the chat then runs to its end, or is cut if it is a long one."""
    async with running_request(s, max_tokens) as request:
        answer = await s.reset(body)
        if max_tokens <= LONG_CHAT_TOKENS:
            assert await request == 200
    return answer


# -- answers by outcome -------------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "llamacpp", "mindnano"])
async def test_idle_engine_reset_is_acknowledged(tmp_path: Path, dialect: str) -> None:
    options = {"slot_save_path": str(tmp_path)} if dialect == "llamacpp" else {}
    async with stack(fast(dialect, **options), tmp_path) as s:
        status, body = await s.reset({"session_id": "s1", "case_id": "c1"})
        stats = await s.engine.stats()
    assert status == 200
    assert body["success"] is True and body["answer"] == "acknowledged"
    assert body["engine"]["kind"] == dialect and body["attempts"] == 1
    assert stats["resets_total"] >= 1


async def test_cache_state_record_has_the_reference_shape(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        _, body = await s.reset({"session_id": "s1", "case_id": "c1", "warmup_requests": 0, "verify": "none"})
    record = body["cache_state"]
    assert set(record) >= REFERENCE_RECORD_KEYS
    assert set(record) - REFERENCE_RECORD_KEYS == {"reset_id", "engine", "at_ns", "verification", "via"}
    assert record["via"] == "api"
    assert set(record["reset"]) == REFERENCE_RESET_KEYS
    assert record["event_type"] == "infer.cache_state" and record["schema_version"] == 1
    assert (record["session_id"], record["case_id"], record["requested"]) == ("s1", "c1", "cold")
    assert (
        record["attempted"] is True and record["acknowledged"] is True and record["verified"] == "unverified"
    )
    assert record["reason"] == "the server acknowledged the cache reset, but no engine adapter can confirm it"
    assert record["run_kind"] == "cold_start"
    assert record["reset_id"] == body["reset_id"] and record["engine"] == body["engine"]
    assert record["reset"]["answer"] == "acknowledged" and record["reset"]["success"] is True
    assert (
        record["reset"]["at_ns"] == body["at_ns"]
        and record["reset"]["answered_at_ns"] == body["answered_at_ns"]
    )


async def test_accepted_unverified_answer_has_no_success_key(tmp_path: Path) -> None:
    async with stack(fast("vllm", legacy_empty_body=True), tmp_path, verify="none") as s:
        status, body = await s.reset()
    assert status == 200
    assert "success" not in body
    assert body["answer"] == "accepted_unverified"
    assert body["cache_state"]["reset"]["success"] is None
    assert body["cache_state"]["reset"]["answer"] == "accepted_unverified"
    assert "without saying whether it succeeded" in body["cache_state"]["reason"]


@pytest.mark.parametrize(
    ("config", "hint_word"),
    [
        (fast("vllm", dev_mode=False), "VLLM_SERVER_DEV_MODE=1"),
        (fast("llamacpp"), "--slot-save-path"),
        (fast("openai"), "reset_path"),
    ],
    ids=["vllm-no-dev-mode", "llamacpp-no-slot-save-path", "openai"],
)
async def test_unsupported_reset_is_501_with_hint(tmp_path: Path, config: SimConfig, hint_word: str) -> None:
    async with stack(config, tmp_path) as s:
        status, body = await s.reset()
    assert status == 501
    assert body["success"] is False and body["answer"] == "unsupported"
    assert hint_word in body["hint"]
    assert body["cache_state"]["reset"]["answer"] is None
    assert body["cache_state"]["reset"]["error"].startswith("unsupported: ")
    assert body["cache_state"]["run_kind"] == "unspecified"


async def test_unreachable_engine_is_502(tmp_path: Path) -> None:
    async with (
        serve_sidecar(closed_port_url(), tmp_path) as sidecar,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        async with http.post(f"{sidecar.url}/cache/reset") as resp:
            status, body = resp.status, await resp.json()
    assert status == 502
    assert body["success"] is False and body["answer"] == "unreachable"
    assert body["cache_state"]["reset"]["answer"] is None
    assert body["cache_state"]["reset"]["error"].startswith("unreachable: ")


# -- retries ------------------------------------------------------------------------------


@pytest.mark.parametrize(("dialect", "refusal_status"), [("vllm", 200), ("mindnano", 429)])
async def test_refused_reset_is_retried_until_the_running_request_ends(
    tmp_path: Path, dialect: str, refusal_status: int
) -> None:
    async with stack(slow(dialect), tmp_path) as s:
        status, body = await reset_while_generating(
            s, {"drain": False, "retry_seconds": 30}, max_tokens=BUSY_CHAT_TOKENS
        )
    assert status == 200 and body["answer"] == "acknowledged"
    assert body["attempts"] > 1
    assert body["drain"]["enabled"] is False
    assert len(body["calls"]) == body["attempts"]
    assert body["calls"][0]["status"] == refusal_status
    assert body["calls"][-1]["status"] == 200


async def test_sglang_waits_for_idle_and_acknowledges_on_the_first_attempt(tmp_path: Path) -> None:
    async with stack(slow("sglang"), tmp_path) as s:
        status, body = await reset_while_generating(s, {"drain": False, "retry_seconds": 30}, max_tokens=60)
    assert status == 200 and body["answer"] == "acknowledged"
    assert body["attempts"] == 1


async def test_mindnano_refused_to_the_end_is_409(tmp_path: Path) -> None:
    async with stack(slow("mindnano"), tmp_path) as s:
        status, body = await reset_while_generating(s, {"drain": False, "retry_seconds": 1}, max_tokens=5000)
    assert status == 409 and body["answer"] == "refused"
    assert 2 <= body["attempts"] <= 3
    assert all(call["status"] == 429 for call in body["calls"])


async def test_llamacpp_busy_slot_is_refused_and_retried_until_it_is_idle(tmp_path: Path) -> None:
    async with stack(slow("llamacpp", slot_save_path=str(tmp_path)), tmp_path) as s:
        status, body = await reset_while_generating(
            s, {"drain": False, "retry_seconds": 30}, max_tokens=BUSY_CHAT_TOKENS
        )
    assert status == 200 and body["answer"] == "acknowledged"
    assert body["attempts"] > 1
    assert [call["url"].rsplit("/", 1)[1] for call in body["calls"][:2]] == ["props", "slots"]


async def test_llamacpp_busy_slot_past_the_retry_window_is_refused(tmp_path: Path) -> None:
    async with stack(slow("llamacpp", slot_save_path=str(tmp_path)), tmp_path) as s:
        status, body = await reset_while_generating(s, {"drain": False, "retry_seconds": 1}, max_tokens=5000)
    assert status == 409 and body["answer"] == "refused" and body["attempts"] >= 2
    assert "busy slot" in body["cache_state"]["reset"]["error"]
    assert not [call for call in body["calls"] if "action=erase" in call["url"]]
    assert "--cache-ram 0" in body["warning"]


# Attempts a window allows against an engine that refuses at once: one at t=0, then one 0.5 s
# after each refusal while at least 0.5 s of the window is left. The windows end mid-interval
# (x.25 s), so slack up to 0.25 s cannot change the count: it is pinned exactly, and stopping
# one interval early (or retrying once too often) fails.
ATTEMPTS_IN_WINDOW = {1.25: 3, 2.25: 5}


def attempts_due(window_s: float, elapsed_s: list[float]) -> int:
    """The attempts the retry loop makes in `window_s` when its calls took `elapsed_s` each.

    The interval runs from each refusal, as the reference client's loop does: on a machine
    busy enough that the calls eat the window's slack (2 cores, a real vLLM beside), the
    count follows the calls' own recorded times, and is still pinned by them.
    """
    now, made = 0.0, 0
    for took in elapsed_s:
        made += 1
        now += took
        if window_s - now < RESET_RETRY_INTERVAL_SECONDS:
            return made
        now += RESET_RETRY_INTERVAL_SECONDS
    return made + 1  # another attempt was due after the last one made: the loop stopped early


@pytest.mark.parametrize("retry_seconds", sorted(ATTEMPTS_IN_WINDOW))
async def test_reset_refused_to_the_end_is_409_and_stops_at_the_deadline(
    tmp_path: Path, retry_seconds: float
) -> None:
    async with stack(slow("vllm"), tmp_path) as s:
        status, body = await reset_while_generating(
            s, {"drain": False, "retry_seconds": retry_seconds}, max_tokens=5000
        )
    assert status == 409
    assert body["success"] is False and body["answer"] == "refused"
    assert len(body["calls"]) == body["attempts"]
    elapsed = [call["elapsed_s"] for call in body["calls"]]
    assert body["attempts"] == attempts_due(retry_seconds, elapsed)
    if sum(elapsed) < 0.1:  # a machine with time to spare: the count the window alone gives
        assert body["attempts"] == ATTEMPTS_IN_WINDOW[retry_seconds]
    reset = body["cache_state"]["reset"]
    assert reset["answer"] == "refused" and reset["success"] is False
    assert reset["error"] == f"refused: success false on {body['attempts']} attempts"
    assert body["cache_state"]["reason"] == f"the cache reset failed ({reset['error']})"
    assert body["cache_state"]["run_kind"] == "unspecified"


async def test_sglang_refusal_waits_through_the_timeout_param(tmp_path: Path) -> None:
    async with stack(slow("sglang"), tmp_path) as s:
        status, body = await reset_while_generating(
            s, {"drain": False, "retry_seconds": 0.5}, max_tokens=5000
        )
    assert status == 409 and body["answer"] == "refused"
    assert body["calls"][0]["url"].endswith("/flush_cache?timeout=0.5")
    assert body["calls"][0]["status"] == 400


# -- drain --------------------------------------------------------------------------------


async def test_drain_lets_the_first_attempt_succeed_and_held_requests_complete(tmp_path: Path) -> None:
    async with stack(slow("vllm"), tmp_path) as s:
        admission = s.app[ADMISSION]
        running = asyncio.create_task(s.chat(max_tokens=100))
        await s.engine.wait_stats(lambda st: st["running"] == 1)
        reset = asyncio.create_task(s.reset({"retry_seconds": 0}))
        await wait_until(lambda: admission.draining)
        held = asyncio.create_task(s.chat(max_tokens=2, content="held"))
        await wait_until(lambda: admission.held == 1)
        status, body = await reset
        assert await running == 200
        assert await held == 200
    assert status == 200 and body["answer"] == "acknowledged"
    assert body["attempts"] == 1
    assert body["drain"]["enabled"] is True
    assert body["drain"]["inflight_at_start"] == 1
    assert body["drain"]["held"] == 1


# -- coalescing ---------------------------------------------------------------------------


async def test_callers_arriving_during_a_reset_share_the_next_one(tmp_path: Path) -> None:
    async with stack(slow("vllm"), tmp_path, verify="none") as s:
        service = s.app[RESETS]
        running = asyncio.create_task(s.chat(max_tokens=5000))
        await s.engine.wait_stats(lambda st: st["running"] == 1)
        first = asyncio.create_task(s.reset({"session_id": "s1", "case_id": "c1"}))
        await wait_until(lambda: s.app[ADMISSION].draining)
        second = asyncio.create_task(s.reset({"session_id": "s2", "case_id": "c2"}))
        third = asyncio.create_task(s.reset({"session_id": "s3", "case_id": "c3"}))
        await wait_until(lambda: service.waiting == 2)
        running.cancel()  # the drained request ends; the first reset can run
        with pytest.raises(asyncio.CancelledError):
            await running
        answers = [await first, await second, await third]
        stats = await s.engine.stats()
    assert [status for status, _ in answers] == [200, 200, 200]
    (_, a1), (_, a2), (_, a3) = answers
    assert stats["resets_total"] == 2  # three callers, two engine resets
    assert a2["reset_id"] == a3["reset_id"] != a1["reset_id"]
    assert [a["cache_state"]["session_id"] for a in (a1, a2, a3)] == ["s1", "s2", "s3"]
    assert [a["cache_state"]["case_id"] for a in (a1, a2, a3)] == ["c1", "c2", "c3"]
    assert a3["coalesced"] is True and a1["coalesced"] is False


async def test_coalesced_round_drains_the_requests_the_round_before_it_let_in(tmp_path: Path) -> None:
    """Round A releases a held request; round B, right behind it, waits for that request (docs/reset.md)."""
    async with stack(slow("vllm"), tmp_path) as s:
        admission, service = s.app[ADMISSION], s.app[RESETS]
        running = asyncio.create_task(s.chat(max_tokens=5000))
        await s.engine.wait_stats(lambda st: st["running"] == 1)
        round_a = asyncio.create_task(s.reset({"retry_seconds": 0, "case_id": "a"}))
        await wait_until(lambda: admission.draining)
        held = asyncio.create_task(s.chat(max_tokens=30, content="held"))
        await wait_until(lambda: admission.held == 1)
        round_b = asyncio.create_task(s.reset({"retry_seconds": 0, "case_id": "b"}))
        await wait_until(lambda: service.waiting == 1)
        running.cancel()  # round A's drain ends: A resets, then lets the held request in
        with pytest.raises(asyncio.CancelledError):
            await running
        (status_a, a), (status_b, b) = await round_a, await round_b
        assert await held == 200
    # vLLM refuses while the held request runs: B acknowledged at once means B waited for it.
    assert (status_a, a["answer"], a["attempts"]) == (200, "acknowledged", 1)
    assert (status_b, b["answer"], b["attempts"]) == (200, "acknowledged", 1), b
    assert a["drain"]["held"] == 1
    assert b["drain"]["inflight_at_start"] == 1 and b["drain"]["waited_s"] > 0


async def test_every_caller_gets_its_own_evidence_record(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        _, body = await s.reset({"session_id": "s9", "case_id": "c9"})
    records = evidence_records(tmp_path / "evidence" / "cachewitness.jsonl")
    states = [r for r in records if r["event_type"] == "infer.cache_state"]
    assert states == [body["cache_state"]]


async def test_reset_is_counted_in_metrics_by_engine_and_answer(tmp_path: Path) -> None:
    async with stack(fast("vllm", dev_mode=False), tmp_path) as s:
        await s.reset()
        async with s.http.get(f"{s.url}/metrics") as resp:
            text = await resp.text()
    assert 'cachewitness_cache_resets_total{answer="unsupported",engine="vllm"} 1.0' in text


# -- engines through the sidecar ----------------------------------------------------------


async def test_sglang_admin_key_goes_to_flush_cache(tmp_path: Path) -> None:
    async with stack(fast("sglang", admin_api_key="k3y"), tmp_path, engine_api_key="k3y") as s:
        status, body = await s.reset()
    assert status == 200 and body["answer"] == "acknowledged"


async def test_llamacpp_reset_erases_every_slot_and_warns(tmp_path: Path) -> None:
    async with stack(fast("llamacpp", slots=3, slot_save_path=str(tmp_path)), tmp_path, verify="none") as s:
        for slot in range(3):
            await s.engine.post_json(
                "/completion", {"prompt": words(20, f"s{slot}"), "n_predict": 2, "id_slot": slot}
            )
        status, body = await s.reset()
        stats = await s.engine.stats()
    assert status == 200 and body["answer"] == "acknowledged"
    assert stats["slot_tokens"] == [0, 0, 0]
    erase_calls = [call for call in body["calls"] if "action=erase" in call["url"]]
    assert len(erase_calls) == 3 and all(call["status"] == 200 for call in erase_calls)
    assert body["cache_state"]["reset"]["url"].endswith("/slots/2?action=erase")
    assert "--cache-ram 0" in body["warning"]


async def test_generic_engine_with_configured_reset_path(tmp_path: Path) -> None:
    async with stack(
        fast("vllm"), tmp_path, engine="generic", reset_path="/reset_prefix_cache", success_field="success"
    ) as s:
        status, body = await s.reset()
    assert status == 200 and body["answer"] == "acknowledged"
    assert body["engine"]["kind"] == "generic"


async def test_engine_none_is_unsupported(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path, engine="none") as s:
        status, body = await s.reset()
        stats = await s.engine.stats()
    assert status == 501 and body["answer"] == "unsupported"
    assert stats["resets_total"] == 0


# -- input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "query", "param"),
    [
        ({"retry_seconds": 500}, "", "retry_seconds"),
        ({"retry_seconds": True}, "", "retry_seconds"),
        ({"session_id": "bad id!"}, "", "session_id"),
        ({"case_id": "x" * 129}, "", "case_id"),
        ({"requested": "warm"}, "", "requested"),
        ({"warmup_requests": -1}, "", "warmup_requests"),
        ({"force": "yes"}, "", "force"),
        ({"bogus": 1}, "", "bogus"),
        (None, "?drain=maybe", "drain"),
        (None, "?retry_seconds=abc", "retry_seconds"),
        (None, "?colour=red", "colour"),
    ],
)
async def test_bad_input_is_400_naming_the_field(tmp_path: Path, body: Any, query: str, param: str) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        data = orjson.dumps(body) if body is not None else None
        async with s.http.post(f"{s.url}/cache/reset{query}", data=data) as resp:
            status, answer = resp.status, await resp.json()
        stats = await s.engine.stats()
    assert status == 400
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    assert stats["resets_total"] == 0


async def test_body_that_is_not_json_is_400(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        async with s.http.post(f"{s.url}/cache/reset", data=b"{not json") as resp:
            status, answer = resp.status, await resp.json()
    assert status == 400 and answer["error"]["code"] == "invalid_json"


async def test_query_parameters_are_accepted(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        status, body = await s.reset(query="?session_id=q1&case_id=q2&drain=false&requested=unspecified")
    assert status == 200
    assert (body["cache_state"]["session_id"], body["cache_state"]["case_id"]) == ("q1", "q2")
    assert body["cache_state"]["requested"] == "unspecified" and body["drain"]["enabled"] is False


async def test_force_reaches_vllm_as_reset_running_requests(tmp_path: Path) -> None:
    async with stack(slow("vllm"), tmp_path) as s:
        status, body = await reset_while_generating(
            s, {"drain": False, "force": True, "retry_seconds": 0}, max_tokens=60
        )
    assert status == 200 and body["attempts"] == 1
    assert "reset_running_requests=true" in body["calls"][0]["url"]
