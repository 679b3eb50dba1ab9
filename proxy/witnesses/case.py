"""The case witness: engine counters read at each reset and case end, and the engine's own events.

A case runs from an accepted reset to its end: the next reset, `POST /cache/cases/{case_id}/close`,
or `case_idle_s` without a request. At each end the engine's counters are read directly and
reconciled with what the sidecar saw (proxy/witnesses/counters.py): an `infer.cache_reconciliation`
record. Between reads a watcher polls the engine (its counters, vLLM's `/is_sleeping`) and writes
what it sees as `infer.engine_event` records: restarted (a counter went down), slept, woke,
unreachable, back (see docs/evidence.md).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import aiohttp

from proxy.engines.counters import SLEEP_ROUTES, Totals, fetch_sleeping, read_totals, read_totals_settled
from proxy.observe import Observation
from proxy.vocabulary import EngineKind, EventType
from proxy.witnesses.counters import CaseVerdict, Reconciliation, Sums, reconcile

__all__ = ["CaseWitness", "EngineEvent", "EventKind"]

_KEPT_EVENTS = 16


class EventKind(StrEnum):
    """`kind` of an `infer.engine_event` record."""

    RESTARTED = "restarted"
    SLEPT = "slept"
    WOKE = "woke"
    UNREACHABLE = "unreachable"
    BACK = "back"


@dataclass(frozen=True)
class EngineEvent:
    """Something that happened to the engine: its cache is empty or unknown after it."""

    kind: EventKind
    at_ns: int
    seen_by: str  # how the sidecar saw it
    reset_id: str | None
    # The case it happened in: a reader filtering by session or case sees the engine's events too.
    session_id: str | None
    case_id: str | None

    def to_record(self) -> dict[str, Any]:
        """The `infer.engine_event` record."""
        return {
            "schema_version": 1,
            "event_type": str(EventType.ENGINE_EVENT),
            "at_ns": self.at_ns,
            "kind": self.kind.value,
            "seen_by": self.seen_by,
            "reset_id": self.reset_id,
            "session_id": self.session_id,
            "case_id": self.case_id,
        }


@dataclass
class _Segment:
    """What the sidecar saw since the last read of the engine's counters."""

    reset_id: str | None
    session_id: str | None
    case_id: str | None
    from_ns: int
    before: Totals | None
    observed: Sums = field(default_factory=Sums)
    unobserved: Sums = field(default_factory=Sums)
    canary: Sums = field(default_factory=Sums)
    last_traffic: float | None = None  # monotonic
    restart_seen: str | None = None  # how a restart (or a sleep) during the segment was seen
    restart_before_traffic: bool = False

    @property
    def traffic(self) -> int:
        """Requests the sidecar saw reach the engine in this segment."""
        return self.observed.requests + self.unobserved.requests


@dataclass
class CaseWitness:
    """Reads and reconciles the engine's counters; watches the engine between reads."""

    session: Callable[[], aiohttp.ClientSession]
    base_url: str
    kind: Callable[[], str]
    timeout_s: float
    idle_s: float
    in_flight: Callable[[], int]
    write: Callable[[dict[str, Any]], None]
    on_bypass: Callable[[int], None] = lambda _n: None
    on_event: Callable[[EventKind], None] = lambda _kind: None
    on_verdict: Callable[[str | None, CaseVerdict, str], None] = lambda _r, _v, _why: None
    api_key: str | None = field(default=None, repr=False)
    _segment: _Segment | None = None
    _baseline: Totals | None = None  # the read at the start of a reset, for the sequence it opens
    _last: Totals | None = None  # the latest totals read, for restart detection
    _sleeping: bool | None = None
    _reachable: bool | None = None
    _reconciled: dict[str, Reconciliation] = field(default_factory=dict)  # latest per reset_id
    events: deque[EngineEvent] = field(default_factory=lambda: deque(maxlen=_KEPT_EVENTS))
    # Set once the first reset opens a sequence: the watcher sleeps on it until then, with
    # no timer (a poll before it does nothing; bench/idle_cpu.py).
    _opened: asyncio.Event = field(default_factory=asyncio.Event)
    # Whether the sidecar forwarded a request since the watcher's last look (llama.cpp: see poll).
    _traffic_since_poll: bool = False

    # -- what the sidecar saw ------------------------------------------------------------------
    def observed(self, obs: Observation) -> None:
        """One observed request that reached the engine."""
        self._traffic_since_poll = True
        if self._segment is not None:
            seg = self._segment
            seg.observed = seg.observed.plus(obs.prompt_tokens, obs.cached_tokens)
            seg.last_traffic = time.monotonic()

    def unobserved(self) -> None:
        """One request the sidecar forwarded without observing it (its tokens are unknown)."""
        self._traffic_since_poll = True
        if self._segment is not None:
            self._segment.unobserved = self._segment.unobserved.plus(None, None)
            self._segment.last_traffic = time.monotonic()

    # -- reads ----------------------------------------------------------------------------------
    async def read(self) -> tuple[bool, Totals | None]:
        """(reachable, totals) from a settled direct read: repeated until two reads agree.

        Not while llama-server sleeps: its /metrics is a task that would wake it (no totals then).
        """
        if self._sleeping and self.kind() == EngineKind.LLAMACPP:
            return True, None
        reachable, totals = await read_totals_settled(
            self.session(), self.base_url, self.kind(), self.timeout_s, self.api_key
        )
        self._note(reachable, totals, "counters read at a case end")
        return reachable, totals

    async def restarted_since(self, wall: float) -> bool:
        """Whether the engine's counters went down since `wall` (a direct read first): a restart
        the HTTP side saw, what an events-only restart needs to count."""
        await self.read()
        since_ns = int(wall * 1e9)
        return any(e.kind == EventKind.RESTARTED and e.at_ns >= since_ns for e in self.events)

    async def reset_started(self) -> None:
        """A reset is about to run (inside its drain window): close the case before it."""
        _reachable, totals = await self.read()
        await self._close_with(totals, "reset")
        self._baseline = totals

    async def reset_finished(
        self, ids: tuple[str | None, str | None, str | None], canary: Sums
    ) -> dict[str, Any] | None:
        """The reset ended: the sequence it leaves (`ids`: a new one if it was accepted) starts at its first read.

        A second read, after the canary, is where a restart during the case is measured from; the
        two reads around the reset are its `witnesses.counters` block (None without counters).
        """
        reset_id, session_id, case_id = ids
        interim = self._segment  # what the sidecar itself forwarded since the first read
        seen = interim.observed.add(interim.unobserved) if interim is not None else Sums()
        self._segment = _Segment(reset_id, session_id, case_id, time.time_ns(), self._baseline, canary=canary)
        self._opened.set()  # the watcher's first look is an interval on, after these reads
        _reachable, after = await self.read()
        if self._sleeping is None:
            # The state a later change is measured from, before the watcher's first look.
            self._sleeping = await fetch_sleeping(
                self.session(), self.base_url, self.timeout_s, self.api_key, self.kind()
            )
        return reset_window(self._baseline, after, seen, canary, self.in_flight())

    async def close(self, case_id: str | None, closed_by: str = "close") -> Reconciliation | None:
        """End the current case (`case_id` must be its own, or None for any); its reconciliation."""
        seg = self._segment
        if seg is None or (case_id is not None and seg.case_id != case_id):
            return None
        _reachable, totals = await self.read()
        return await self._close_with(totals, closed_by)

    async def _close_with(self, totals: Totals | None, closed_by: str) -> Reconciliation | None:
        """Reconcile the open segment against `totals`; the next segment starts from them."""
        seg = self._segment
        if seg is None:
            return None
        engine, bypass, restarted, verdict, reason = reconcile(
            seg.before,
            totals,
            seen=seg.observed.add(seg.unobserved),
            canary=seg.canary,
            in_flight_at_read=self.in_flight(),
            restart_seen=seg.restart_seen,
            restart_before_traffic=seg.restart_before_traffic,
        )
        done = Reconciliation(
            seg.reset_id,
            seg.session_id,
            seg.case_id,
            self.kind(),
            closed_by,
            seg.from_ns,
            time.time_ns(),
            engine,
            seg.observed,
            seg.unobserved,
            seg.canary,
            bypass,
            self.in_flight(),
            restarted,
            verdict,
            reason,
        )
        self.write(done.to_record())
        if seg.reset_id is not None:
            self._reconciled[seg.reset_id] = done
            if len(self._reconciled) > _KEPT_EVENTS:
                self._reconciled.pop(next(iter(self._reconciled)))
        if bypass is not None and (bypass["requests"] or 0) > 0:
            self.on_bypass(bypass["requests"] or 0)
        if verdict != CaseVerdict.CONSISTENT:
            self.on_verdict(seg.reset_id, verdict, reason)
        # Traffic after a case end, until the next reset, is a case of its own (no case_id).
        self._segment = _Segment(seg.reset_id, seg.session_id, None, time.time_ns(), totals)
        return done

    # -- the watcher ----------------------------------------------------------------------------
    def _note(self, reachable: bool, totals: Totals | None, how: str) -> None:
        """Events from one read: unreachable/back, and a counter that went down (a restart)."""
        if reachable != self._reachable:
            if self._reachable is not None:
                self._event(EventKind.BACK if reachable else EventKind.UNREACHABLE, "its /metrics")
            self._reachable = reachable
        if totals is None:
            return
        last = self._last
        if last is not None and _went_down(last, totals):
            self._event(EventKind.RESTARTED, f"a counter went down ({how})")
        self._last = totals

    def _event(self, kind: EventKind, seen_by: str) -> None:
        """Record one engine event; a restart marks the open case."""
        seg = self._segment
        event = EngineEvent(
            kind,
            time.time_ns(),
            seen_by,
            seg.reset_id if seg is not None else None,
            seg.session_id if seg is not None else None,
            seg.case_id if seg is not None else None,
        )
        self.events.append(event)
        self.write(event.to_record())
        self.on_event(kind)
        # After a restart, a sleep or a wake the cache is cold: the case is judged as after a restart.
        cold = (EventKind.RESTARTED, EventKind.SLEPT, EventKind.WOKE)
        if seg is not None and kind in cold and seg.restart_seen is None:
            seg.restart_seen = f"{kind.value}: {seen_by}"
            seg.restart_before_traffic = seg.traffic == 0

    async def poll(self) -> None:
        """One look at the engine: counters (restarts, reachability), sleep state, an idle case.

        Only once a reset opened a sequence: before it there is no case to witness, and the
        engine's /metrics is fetched for scrapes only (shared, one per second).
        """
        if self._segment is None:
            return
        session, kind = self.session(), self.kind()
        if kind == EngineKind.LLAMACPP:
            # First: a sleeping llama-server's /metrics would wake it; /props does not.
            await self._look_at_sleep(session, kind)
        # llama-server's /metrics is a task, and any task restarts its idle clock (server_queue::post):
        # read while idle, it would never fall asleep. So it is read after traffic only.
        quiet = kind == EngineKind.LLAMACPP and (self._sleeping or not self._traffic_since_poll)
        self._traffic_since_poll = False
        if not quiet:
            reachable, totals = await read_totals(session, self.base_url, kind, self.timeout_s, self.api_key)
            self._note(reachable, totals, "engine watcher")
            if kind == EngineKind.VLLM and reachable:
                await self._look_at_sleep(session, kind)
        seg = self._segment
        if (
            seg is not None
            and seg.last_traffic is not None
            and time.monotonic() - seg.last_traffic >= self.idle_s
            and self.in_flight() == 0
        ):
            await self.close(None, "idle")

    async def _look_at_sleep(self, session: aiohttp.ClientSession, kind: str) -> None:
        """The engine's sleep state; a change is a `slept` or `woke` event."""
        sleeping = await fetch_sleeping(session, self.base_url, self.timeout_s, self.api_key, kind)
        if sleeping is not None and self._sleeping is not None and sleeping != self._sleeping:
            self._event(EventKind.SLEPT if sleeping else EventKind.WOKE, f"{kind} {SLEEP_ROUTES[kind]}")
        if sleeping is not None:
            self._sleeping = sleeping

    async def watch(self, interval_s: float) -> None:
        """Poll every interval once a reset opened a sequence (cancelled at shutdown)."""
        await self._opened.wait()
        await asyncio.sleep(interval_s)  # the first look: an interval after the sequence opened
        while True:
            started = time.monotonic()
            await self.poll()
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    # -- /cache/state ---------------------------------------------------------------------------
    def state(self, reset_id: str | None) -> dict[str, Any]:
        """`bypass` (the last reconciliation of `reset_id`) and the latest engine events."""
        done = self._reconciled.get(reset_id) if reset_id is not None else None
        return {
            "bypass": done.bypass if done is not None else None,
            "reconciliation": done.to_record() if done is not None else None,
            "engine_events": [event.to_record() for event in self.events],
        }


def reset_window(
    before: Totals | None, after: Totals | None, seen: Sums, canary: Sums, in_flight: int
) -> dict[str, Any] | None:
    """The counter witness of the reset itself: inside its drain window only the canary may reach the engine.

    `consistent`: the engine's deltas are the canary's (and what the sidecar forwarded); `contradicted`:
    other traffic hit the cache while the canary measured it; `inconclusive`: other traffic without
    cached tokens, or a restart.
    """
    if before is None or after is None:
        return None
    engine, bypass, _restarted, verdict, reason = reconcile(
        before,
        after,
        seen=seen,
        canary=canary,
        in_flight_at_read=in_flight,
        restart_seen=None,
        restart_before_traffic=False,
    )
    return {
        "result": verdict.value,
        "reason": reason,
        "engine": engine,
        "canary": canary.to_json(),
        "observed": seen.to_json(),
        "bypass": bypass,
        "in_flight_at_read": in_flight,
    }


def _went_down(before: Totals, after: Totals) -> bool:
    """Whether any counter is lower than before: the engine started counting again."""
    pairs = (
        (before.requests, after.requests),
        (before.prompt_tokens, after.prompt_tokens),
        (before.cached_tokens, after.cached_tokens),
    )
    return any(b is not None and a is not None and a < b for b, a in pairs)
