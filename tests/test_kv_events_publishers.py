"""Who may publish on the KV-events socket the sidecar binds (issue 45, M2): the engine, once.

A rogue publisher (tests/support/kv_events.py) that can reach the socket tries to forge the events
witness: its clears and its "restarts" must never verify a reset the engine did not clear.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from proxy.witnesses.kv_events.subscribers import KvEvents, KvEventsConfig, RankSnapshot
from tests.support.kv_events import CLEAR, Ports, engine, flooding, rogue, rogue_stack, sidecar_events, until
from tests.support.metrics import scrape
from tests.support.sidecar import Stack, stack
from tests.support.sim import chat, words

# Warm prompts sent until one's blocks are seen, and the wait for each (tests' bound: 20 × 0.5 s).
_WARM_TRIES = 20
_WARM_WAIT_S = 0.5


@asynccontextmanager
async def publishing_engine(tmp_path: Path) -> AsyncIterator[tuple[Stack, KvEvents, Ports]]:
    """A vLLM simulator publishing its events to the sidecar, once its publisher is connected."""
    ports = Ports()
    async with stack(engine("vllm", ports), tmp_path, kv_events_endpoint=ports.endpoint) as s:
        events = sidecar_events(s)
        await until(events, lambda snaps: snaps[0].connected)
        yield s, events, ports


def extra_publishers(count: int) -> Callable[[tuple[RankSnapshot, ...]], bool]:
    """Whether rank 0 has counted `count` second publishers."""
    return lambda snaps: snaps[0].extra_publishers == count


async def _cache_prompt(s: Stack, tag: str = "warm") -> None:
    status, _ = await s.engine.post_json("/v1/chat/completions", chat(words(64, tag), 1))
    assert status == 200


async def _warm(s: Stack, events: KvEvents) -> None:
    """Cache a prompt and wait until its blocks are in the index. A SUB's subscription reaches the
    PUB some time after it connects (ZeroMQ's slow joiner: longer on a loaded machine), and what
    the engine publishes before that is lost, so a fresh prompt is sent until one is seen."""
    for attempt in range(_WARM_TRIES):
        await _cache_prompt(s, f"warm{attempt}")
        if await events.wait_until(lambda snaps: sum(snaps[0].blocks.values()) > 0, _WARM_WAIT_S):
            return
    raise AssertionError(f"no stored block reached the index; last {events.snapshots()}")


async def test_a_publisher_from_another_address_is_refused(tmp_path: Path) -> None:
    # The engine is at 127.0.0.1 (the upstream's host); the rogue connects from 127.0.0.2.
    async with rogue_stack(tmp_path, source="127.0.0.2") as (s, pub), flooding(pub):
        events = sidecar_events(s)
        await until(events, lambda snaps: snaps[0].refused_publishers > 0)
        status, answer = await s.reset({"verify": "events"})
        metrics = await scrape(s.http, s.url)
    assert status == 200 and answer["verified"] == "unverified", answer["verification"]
    assert events.snapshots()[0].batches == 0
    assert metrics.value("cachewitness_kv_event_publishers_refused_total") > 0


async def test_listed_publishers_are_admitted(tmp_path: Path) -> None:
    async with rogue_stack(tmp_path, source="127.0.0.2", kv_events_publishers=("127.0.0.2",)) as (s, pub):
        assert await pub.subscribed()
        await pub.send(0, CLEAR)
        await until(sidecar_events(s), lambda snaps: snaps[0].clears == 1)


async def test_a_restart_the_counters_did_not_see_does_not_verify(tmp_path: Path) -> None:
    # The rogue is the only publisher, from the engine's own address: its seq 0 every 50 ms reads
    # as an engine restart after the reset. The engine's counters never went down.
    async with rogue_stack(tmp_path) as (s, pub):
        assert await pub.subscribed()
        await _cache_prompt(s)
        for seq in range(3):
            await pub.send(seq, [["BlockStored", [seq + 1], None, [], 16, None, "GPU"]])
        await until(sidecar_events(s), lambda snaps: snaps[0].last_seq == 2)
        async with flooding(pub, repeat=True, events=[["BlockStored", [9], None, [], 16, None, "GPU"]]):
            status, answer = await s.reset({"verify": "events"})
    events = answer["verification"]["witnesses"]["events"]
    assert status == 200 and answer["verified"] == "unverified", events
    assert events["ranks"][0]["restarted"] is True and events["ranks"][0]["cleared"] is False
    assert "its counters saw no restart" in events["reason"]


async def test_a_second_publisher_beside_the_engine_is_an_alarm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with publishing_engine(tmp_path) as (s, events, ports):
        async with rogue(ports.endpoint) as pub:
            assert await pub.subscribed()
            snaps = await until(events, lambda snaps: snaps[0].publishers == 2)
            assert snaps[0].extra_publishers == 1 and not snaps[0].vouches
            await pub.send(0, CLEAR)  # a clear syncs the set again, but whose was it?
            snaps = await until(events, lambda snaps: snaps[0].clears == 1)
            assert snaps[0].synced and not snaps[0].vouches
            status, answer = await s.reset({"verify": "events"})
            metrics = await scrape(s.http, s.url)
    events_report = answer["verification"]["witnesses"]["events"]
    assert status == 200 and answer["verified"] == "unverified", events_report
    assert "a second publisher" in events_report["reason"]
    assert metrics.value("cachewitness_kv_event_publishers_extra_total") == 1
    assert any(r.levelno == logging.ERROR and "second publisher" in r.getMessage() for r in caplog.records)


async def test_a_second_publisher_reconnecting_is_counted_each_time_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with publishing_engine(tmp_path) as (_s, events, ports):
        for n in range(1, 6):
            async with rogue(ports.endpoint) as pub:
                assert await pub.subscribed()
                await until(events, extra_publishers(n))
            await until(events, lambda snaps: snaps[0].publishers == 1)
    alarms = [r for r in caplog.records if "second publisher" in r.getMessage()]
    assert len(alarms) == 1 and alarms[0].levelno == logging.ERROR, alarms


async def test_after_a_second_publisher_leaves_nothing_vouches_until_a_lone_clear(tmp_path: Path) -> None:
    # Beside the engine, the rogue sends a seq 0 that empties the index (a "restart"), then leaves:
    # the engine still holds its blocks, so the index must not vouch for its emptiness.
    async with publishing_engine(tmp_path) as (s, events, ports):
        await _warm(s, events)
        async with rogue(ports.endpoint) as pub:
            assert await pub.subscribed()
            await pub.send(0, [])
            await until(events, lambda snaps: snaps[0].restarts == 1)
        snaps = await until(events, lambda snaps: snaps[0].publishers == 1)
        assert snaps[0].blocks == {} and snaps[0].synced and not snaps[0].vouches, snaps
        await s.reset({"verify": "events"})  # the engine's own clear, with it alone on the socket
        snaps = await until(events, lambda snaps: snaps[0].clears >= 1)
        assert snaps[0].vouches, snaps


async def test_publishers_are_resolved_at_start_and_an_unknown_host_fails_it() -> None:
    ports = Ports()
    async with KvEvents(KvEventsConfig(ports.endpoint, publishers=("localhost",))) as kv:
        async with rogue(ports.endpoint) as pub:
            assert await pub.subscribed()  # localhost names 127.0.0.1
        assert kv.snapshots()[0].refused_publishers == 0
        async with rogue(ports.endpoint, source="127.0.0.2"):
            await until(kv, lambda snaps: snaps[0].refused_publishers > 0)  # and no other address
    with pytest.raises(OSError, match=re.escape("cannot resolve the publisher host 'no-such-host.invalid'")):
        async with KvEvents(KvEventsConfig(ports.endpoint, publishers=("no-such-host.invalid",))):
            pass
