"""The engine's cache index between resets: `infer.cache_blocks` records and the kv events metrics.

At each reset and at each case's start (its `X-Case-Id` first seen) the sidecar writes how many
blocks each engine rank holds, per medium, as its KV cache events say (docs/evidence.md). A case
that starts on a non-empty index after a reset that left it empty and verified had other traffic
reach the engine in between: its record says `flagged`, with the blocks' count.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from proxy.config import SETTINGS, Settings
from proxy.vocabulary import EventType, Verified
from proxy.witnesses.kv_events.subscribers import KvEvents, KvEventsConfig, RankSnapshot
from proxy.witnesses.kv_events.wire import CLEARED, DEVICE, REMOVED, STORED

__all__ = ["CACHE_BLOCKS_EVENT", "CacheIndex", "kv_events_config", "setup_kv_events", "wants_discovery"]

CACHE_BLOCKS_EVENT = EventType.CACHE_BLOCKS
_EVENT_TYPES = (STORED, REMOVED, CLEARED)
# Cases remembered as started; past it the oldest is forgotten (and would count as new again).
_CASES_MAX = 65_536
_PREFIX = "cachewitness_"

Write = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class _LastReset:
    """The last accepted reset, as the case-start check needs it."""

    reset_id: str
    verified: Verified
    empty_after: bool  # the index vouched for an empty cache when the reset answered


def _ranks_json(snaps: tuple[RankSnapshot, ...]) -> list[dict[str, Any]]:
    return [
        {
            "rank": s.rank,
            "blocks": dict(s.blocks),
            "vouches": s.vouches,
            "connected": s.connected,
            "last_seq": s.last_seq,
            "restarts": s.restarts,
        }
        for s in snaps
    ]


def _total(snaps: tuple[RankSnapshot, ...]) -> int:
    return sum(sum(s.blocks.values()) for s in snaps)


class CacheIndex:
    """The KV events subscribers of one engine and what the sidecar records from them."""

    def __init__(self, events: KvEvents, write: Write) -> None:
        """Follow `events`; records go to `write` (the evidence log)."""
        self.events = events
        self._write = write
        self._cases: OrderedDict[tuple[str | None, str], None] = OrderedDict()
        self._last: _LastReset | None = None

    def reset_answered(
        self, *, reset_id: str, session_id: str | None, case_id: str | None, verified: Verified
    ) -> dict[str, Any]:
        """Record the index as a reset leaves it; the record written (none before subscribers run)."""
        if not self.events.running:
            return {}
        snaps = self.events.snapshots()
        empty = all(s.vouches for s in snaps) and _total(snaps) == 0
        self._last = _LastReset(reset_id, verified, empty)
        record = self._record("reset", snaps, reset_id=reset_id, session_id=session_id, case_id=case_id)
        self._write(record)
        return record

    def request_started(self, session_id: str | None, case_id: str | None) -> dict[str, Any] | None:
        """A request reaches the engine: the record of its case's start when it is the case's first."""
        if case_id is None or not self.events.running:
            return None
        key = (session_id, case_id)
        if key in self._cases:
            return None
        self._cases[key] = None
        if len(self._cases) > _CASES_MAX:
            self._cases.popitem(last=False)
        snaps = self.events.snapshots()
        last = self._last
        record = self._record(
            "case_start",
            snaps,
            reset_id=None if last is None else last.reset_id,
            session_id=session_id,
            case_id=case_id,
        )
        record["verification"] = _case_check(last, snaps)
        self._write(record)
        return record

    @staticmethod
    def _record(
        trigger: str,
        snaps: tuple[RankSnapshot, ...],
        *,
        reset_id: str | None,
        session_id: str | None,
        case_id: str | None,
    ) -> dict[str, Any]:
        record = {
            "schema_version": 1,
            "event_type": CACHE_BLOCKS_EVENT,
            "at_ns": time.time_ns(),
            "trigger": trigger,
            "reset_id": reset_id,
            "session_id": session_id,
            "case_id": case_id,
            "blocks": _total(snaps),
            "vouches": all(s.vouches for s in snaps),
            "ranks": _ranks_json(snaps),
        }
        return record


def _case_check(last: _LastReset | None, snaps: tuple[RankSnapshot, ...]) -> dict[str, Any]:
    """`clean`, `flagged` or `unknown`: did the case start on the empty cache its reset left?"""
    if last is None or last.verified != Verified.VERIFIED or not last.empty_after:
        why = "no reset before this case left a verified, empty index"
        return {"result": "unknown", "reason": why}
    if not all(s.vouches for s in snaps):
        return {"result": "unknown", "reason": "the engine's events since the reset are incomplete"}
    held = _total(snaps)
    if held:
        reason = (
            f"the case started on {held} cached blocks after the verified reset {last.reset_id}: "
            "other traffic reached the engine in between"
        )
        return {"result": "flagged", "reason": reason, "blocks": held}
    return {"result": "clean", "reason": f"the case started on the empty cache of reset {last.reset_id}"}


class KvEventsCollector(Collector):
    """`cachewitness_kv_*`, read from the subscribers at scrape time."""

    def __init__(self, events: KvEvents) -> None:
        """Read `events` at each scrape."""
        self._events = events

    def collect(self) -> Iterator[Metric]:
        """Events per type, gaps, live blocks per medium, and whether every rank's publisher is there."""
        if self._events.config is None:
            return  # discovery found no publisher yet: no KV events families (as without the witness)
        snaps = self._events.snapshots()
        total = CounterMetricFamily(
            _PREFIX + "kv_events_total",
            "KV cache events received from the engine, by type.",
            labels=("type",),
        )
        for kind in sorted(set(_EVENT_TYPES) | {k for s in snaps for k in s.events}):
            total.add_metric((kind,), sum(s.events.get(kind, 0) for s in snaps))
        yield total
        yield CounterMetricFamily(
            _PREFIX + "kv_event_gaps_total",
            "Gaps in the engine's KV event sequence numbers (replayed or not).",
            value=sum(s.gaps for s in snaps),
        )
        blocks = GaugeMetricFamily(
            _PREFIX + "kv_blocks",
            "Blocks the engine's cache holds by its KV events, by medium.",
            labels=("medium",),
        )
        for medium in sorted({DEVICE} | {m for s in snaps for m in s.blocks}):
            blocks.add_metric((medium,), sum(s.blocks.get(medium, 0) for s in snaps))
        yield blocks
        yield CounterMetricFamily(
            _PREFIX + "kv_event_publishers_extra_total",
            "Publishers that connected to a rank's KV-events socket while another one was (an alarm).",
            value=sum(s.extra_publishers for s in snaps),
        )
        yield CounterMetricFamily(
            _PREFIX + "kv_event_publishers_refused_total",
            "Publishers refused in the handshake: not from kv_events_publishers' addresses.",
            value=sum(s.refused_publishers for s in snaps),
        )
        yield GaugeMetricFamily(
            _PREFIX + "kv_events_up",
            "1 when every engine rank's KV event publisher is connected.",
            value=1 if snaps and all(s.up and s.connected for s in snaps) else 0,
        )

    def describe(self) -> Iterator[Metric]:
        """Nothing up front."""
        return iter(())


def kv_events_config(settings: Settings) -> KvEventsConfig | None:
    """The subscribers' configuration, None when no `kv_events_endpoint` is set."""
    if not settings.kv_events_endpoint:
        return None
    return KvEventsConfig(
        settings.kv_events_endpoint,
        settings.kv_events_replay or None,
        ranks=settings.kv_events_ranks,
        topic=settings.kv_events_topic,
        publishers=_publishers(settings),
    )


def wants_discovery(settings: Settings) -> bool:
    """Discovery is on (`auto`) and no static kv_events_endpoint overrides it."""
    return settings.kv_events_discovery == "auto" and not settings.kv_events_endpoint


def _publishers(settings: Settings) -> tuple[str, ...]:
    """The hosts admitted to publish: as configured, else the engine's (the upstream URL's host)."""
    if settings.kv_events_publishers is not None:
        return settings.kv_events_publishers
    host = urlsplit(settings.upstream).hostname
    return (host,) if host else ()


def setup_kv_events(app: web.Application, write: Write, registry: CollectorRegistry) -> CacheIndex | None:
    """With `kv_events_endpoint` set: the subscribers, bound at start (a port taken fails the start)
    and closed at shutdown, their metrics on `registry` (at 0 until events come), and the index
    over them, which the recorder alone writes to; None without."""
    config = kv_events_config(app[SETTINGS])
    if config is None and not wants_discovery(app[SETTINGS]):
        return None
    events = KvEvents(config)  # None: opened once the engine names its publishers (discovery.py)
    index = CacheIndex(events, write)
    registry.register(KvEventsCollector(events))

    async def lifetime(_app: web.Application) -> AsyncIterator[None]:
        await events.start()
        try:
            yield
        finally:
            await events.close()

    app.cleanup_ctx.append(lifetime)
    return index
