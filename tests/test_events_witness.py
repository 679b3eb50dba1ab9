"""The events witness through the sidecar: a simulated engine publishes its KV events to `serve`'s app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson

from tests.support.kv_events import Ports, engine, flooding, rogue_stack, sidecar_events, until
from tests.support.sidecar import Stack, stack
from tests.support.sim import chat, words


@asynccontextmanager
async def events_stack(tmp_path: Path, *, replay: bool = True, **sim_options: Any) -> AsyncIterator[Stack]:
    """A vLLM simulator publishing to a sidecar that binds `kv_events_endpoint`, once it is connected."""
    ports = Ports()
    overrides: dict[str, Any] = {"kv_events_endpoint": ports.endpoint}
    if replay:
        overrides["kv_events_replay"] = ports.replay_endpoint
    async with stack(engine("vllm", ports, **sim_options), tmp_path, **overrides) as s:
        await until(sidecar_events(s), lambda snaps: snaps[0].connected)
        yield s


async def _traffic(s: Stack, tag: str, headers: dict[str, str] | None = None) -> None:
    async with s.http.post(
        f"{s.url}/v1/chat/completions", json=chat(words(40, tag), 2), headers=headers or {}
    ) as resp:
        assert resp.status == 200
        await resp.read()


def _records(tmp_path: Path) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for path in (tmp_path / "evidence").glob("*.jsonl"):
        found.extend(orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip())
    return [r for r in found if r.get("event_type") == "infer.cache_blocks"]


async def test_a_reset_is_verified_by_the_clear_its_flush_probe_released(tmp_path: Path) -> None:
    async with events_stack(tmp_path) as s:
        await _traffic(s, "a")
        status, answer = await s.reset({"verify": "events"})
        events = answer["verification"]["witnesses"]["events"]
        assert status == 200 and answer["verified"] == "verified", events
        assert events["ranks"][0]["cleared"] is True and events["blocks_before"] > 0
        assert events["flush_probe"]["status"] == 200
        assert "canary" not in answer["verification"]["witnesses"]
        assert answer["cache_state"]["verified"] == "verified"
        assert answer["cache_state"]["verification"]["witnesses"]["events"]["result"] == "verified"


async def test_both_witnesses_must_agree_and_the_case_starts_clean(tmp_path: Path) -> None:
    async with events_stack(tmp_path) as s:
        await _traffic(s, "a")
        status, answer = await s.reset({"session_id": "s1", "case_id": "c1"})  # default: both
        witnesses = answer["verification"]["witnesses"]
        assert status == 200 and answer["verified"] == "verified", witnesses
        assert {name: w["result"] for name, w in witnesses.items()} == {
            "events": "verified",
            "canary": "verified",
        }
        await _traffic(s, "b", {"X-Session-Id": "s1", "X-Case-Id": "c1"})
        await _traffic(s, "c", {"X-Session-Id": "s1", "X-Case-Id": "c1"})  # not a new start
    starts = [r for r in _records(tmp_path) if r["trigger"] == "case_start"]
    assert len(starts) == 1 and starts[0]["verification"]["result"] == "clean", starts


async def test_traffic_between_the_reset_and_the_case_is_flagged(tmp_path: Path) -> None:
    async with events_stack(tmp_path) as s:
        _status, answer = await s.reset({"verify": "events"})
        assert answer["verified"] == "verified", answer["verification"]
        await _traffic(s, "other")
        await until(sidecar_events(s), lambda snaps: sum(snaps[0].blocks.values()) > 0)
        await _traffic(s, "mine", {"X-Case-Id": "c2"})
    (start,) = [r for r in _records(tmp_path) if r["trigger"] == "case_start"]
    check = start["verification"]
    assert check["result"] == "flagged" and check["blocks"] == start["blocks"] > 0, start
    assert f"{check['blocks']} cached blocks" in check["reason"]


async def test_a_lost_batch_that_cannot_be_replayed_leaves_the_reset_unverified(tmp_path: Path) -> None:
    # Every 2nd batch is not sent and the sidecar has no replay address: the clear may be lost.
    async with events_stack(tmp_path, replay=False, kv_events_drop_every=2) as s:
        for tag in ("a", "b"):
            await _traffic(s, tag)
        status, answer = await s.reset({"verify": "events"})
    events = answer["verification"]["witnesses"]["events"]
    assert status == 200 and answer["verified"] == "unverified", events
    assert "could not be replayed" in events["reason"], events


async def test_the_kv_events_metrics_are_there_from_the_start(tmp_path: Path) -> None:
    async with events_stack(tmp_path) as s:
        async with s.http.get(f"{s.url}/metrics") as resp:
            text = await resp.text()
    for line in (
        'cachewitness_kv_events_total{type="AllBlocksCleared"} 0.0',
        "cachewitness_kv_event_gaps_total 0.0",
        'cachewitness_kv_blocks{medium="GPU"} 0.0',
        "cachewitness_kv_events_up 1.0",
    ):
        assert line in text, line


async def test_both_is_unverified_when_the_events_lost_a_batch_the_canary_verified(tmp_path: Path) -> None:
    # Every 2nd batch is not sent and there is no replay address: the events cannot vouch, the
    # canary can; `both` is `verified` only when every witness that ran says so.
    async with events_stack(tmp_path, replay=False, kv_events_drop_every=2) as s:
        for tag in ("a", "b"):
            await _traffic(s, tag)
        status, answer = await s.reset({"verify": "both"})
    witnesses = answer["verification"]["witnesses"]
    assert {name: w["result"] for name, w in witnesses.items()} == {
        "events": "unverified",
        "canary": "verified",
    }, witnesses
    assert status == 200 and answer["verified"] == "unverified"
    assert answer["cache_state"]["verified"] == "unverified"


async def test_a_case_start_after_lost_batches_is_unknown_not_clean(tmp_path: Path) -> None:
    # The only publisher (from the engine's address) clears during a verified reset, then loses a
    # batch for good (no replay address): the index holds no block, but it can no longer say so.
    async with rogue_stack(tmp_path) as (s, pub):
        assert await pub.subscribed()
        async with flooding(pub) as next_seq:
            _status, answer = await s.reset({"verify": "events"})
        assert answer["verified"] == "verified", answer["verification"]
        await pub.send(next_seq() + 1, [])  # the batch at next_seq() never comes
        await until(sidecar_events(s), lambda snaps: snaps[0].unreplayed_gaps == 1)
        snap = sidecar_events(s).snapshots()[0]
        assert snap.blocks == {} and not snap.vouches
        await _traffic(s, "mine", {"X-Case-Id": "c1"})
    (start,) = [r for r in _records(tmp_path) if r["trigger"] == "case_start"]
    assert start["verification"]["result"] == "unknown", start
    assert start["blocks"] == 0 and start["vouches"] is False
