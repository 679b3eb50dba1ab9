"""The events witness at reset time: did every engine rank publish an AllBlocksCleared after the reset?

The order is fixed by vLLM: it publishes an accepted reset's AllBlocksCleared only with its next
engine step, so after the reset the sidecar sends a flush probe (a prompt shorter than one cache
block, `max_tokens: 1`: it stores no block) and then waits for the clear. Only a clear taken
after the marker counts, only with no unreplayed gap, a synced set and no overflow
(proxy/witnesses/kv_events/state.py judges each rank); anything less is `unverified`, never a guess.
The events never contradict a reset: a missing clear may be a lost batch (docs/reset.md).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson

from proxy.engines.base import CacheReset
from proxy.engines.call import EngineCall, bearer, engine_call
from proxy.vocabulary import Verified, VerifyMode
from proxy.witnesses.kv_events.state import ClearResult, RankClear
from proxy.witnesses.kv_events.subscribers import KvEvents
from proxy.witnesses.verification import Verification

__all__ = [
    "CLEAR_TIMEOUT_S",
    "FLUSH_PROMPT",
    "EventsCheck",
    "WitnessReport",
    "combine",
    "events_report",
    "merged",
]

# How long the witness waits for every rank's clear after the flush probe answered. Real vLLM
# CPU released it 13-161 ms after the probe (docs/engines.md); a lost batch is replayed within it.
CLEAR_TIMEOUT_S = 2.0
# A few tokens in any tokenizer: shorter than one cache block, so the probe stores nothing.
FLUSH_PROMPT = "ok"


@dataclass(frozen=True)
class WitnessReport:
    """One witness's result for one reset: `verification.witnesses[name]` in answers and records."""

    result: Verified
    reason: str
    numbers: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """`{"result", "reason", ...its numbers}`."""
        return {"result": self.result.value, "reason": self.reason, **self.numbers}


def combine(reports: Mapping[str, WitnessReport]) -> Verified:
    """`verified` only when every witness that ran says so, `contradicted` when any does."""
    results = [report.result for report in reports.values()]
    if not results:
        return Verified.UNVERIFIED
    if Verified.CONTRADICTED in results:
        return Verified.CONTRADICTED
    if all(result == Verified.VERIFIED for result in results):
        return Verified.VERIFIED
    return Verified.UNVERIFIED


def _rank_json(rank: RankClear) -> dict[str, Any]:
    return {
        "rank": rank.rank,
        "cleared": rank.cleared,
        "restarted": rank.restarted,
        "seq": rank.seq,
        "seq_from": rank.seq_from,
        "seq_to": rank.seq_to,
        "blocks": dict(rank.blocks),
        "stored_since_clear": rank.stored_since_clear,
        "unreplayed_gaps": rank.unreplayed_gaps,
        "synced": rank.synced,
        "overflow": rank.overflow,
        "connected": rank.connected,
        "elapsed_s": None if rank.elapsed_s is None else round(rank.elapsed_s, 6),
    }


def _why_not(rank: RankClear, timeout_s: float, restart_seen: bool) -> str | None:
    """Why one rank cannot vouch for the reset, None when it does."""
    if rank.vouches and (rank.cleared or restart_seen):
        return None
    if rank.extra_publishers:
        return (
            f"a second publisher connected to rank {rank.rank}'s events socket: "
            "either one's batches could be forged"
        )
    if rank.vouches:
        # A seq that starts again is all a restart is on the events socket, and anyone who can
        # publish can send one: it counts only when the engine's own counters went down too.
        return (
            f"rank {rank.rank}'s events say the engine restarted, but its counters saw no restart "
            "(an events-only restart is not taken for a clear)"
        )
    if rank.overflow:
        return f"rank {rank.rank}'s block set outgrew its cap (overflow): its content is unknown"
    if rank.unreplayed_gaps:
        return f"rank {rank.rank} lost {rank.unreplayed_gaps} event batch(es) that could not be replayed"
    if not (rank.cleared or rank.restarted):
        where = "" if rank.connected else " (no publisher is connected)"
        return f"rank {rank.rank} published no AllBlocksCleared within {timeout_s:g} s of the reset{where}"
    return f"rank {rank.rank}'s events since the clear are incomplete (not synced)"


def events_report(
    result: ClearResult | None,
    *,
    blocks_before: int,
    flush: EngineCall | None,
    timeout_s: float,
    problem: str = "",
    restart_seen: bool = False,
) -> WitnessReport:
    """The events witness's result from `cleared_since`'s answer (None: it was not asked)."""
    numbers: dict[str, Any] = {
        "blocks_before": blocks_before,
        "flush_probe": None
        if flush is None
        else {"status": flush.status, "elapsed_s": round(flush.elapsed_s, 6)},
    }
    if result is None:
        return WitnessReport(Verified.UNVERIFIED, problem or "the events witness was not asked", numbers)
    numbers["elapsed_s"] = round(result.elapsed_s, 6)
    numbers["timed_out"] = result.timed_out
    numbers["ranks"] = [_rank_json(rank) for rank in result.ranks]
    reasons = [why for rank in result.ranks if (why := _why_not(rank, timeout_s, restart_seen)) is not None]
    if reasons:
        if flush is not None and (flush.status is None or not 200 <= flush.status < 300):
            reasons.append(f"the flush probe failed ({flush.error or f'HTTP {flush.status}'})")
        return WitnessReport(Verified.UNVERIFIED, "; ".join(reasons), numbers)
    restarted = [str(rank.rank) for rank in result.ranks if rank.restarted and not rank.cleared]
    how = (
        f"AllBlocksCleared from every rank ({len(result.ranks)})"
        if not restarted
        else (f"AllBlocksCleared or a restart (rank {', '.join(restarted)}) from every rank")
    )
    return WitnessReport(
        Verified.VERIFIED,
        f"{how} after the reset, with no event lost ({blocks_before} blocks before)",
        numbers,
    )


ResetCall = Callable[[], Awaitable[CacheReset]]
# Whether the HTTP side saw the engine restart since a wall-clock time (its counters went down).
RestartSeen = Callable[[float], Awaitable[bool]]


@dataclass
class EventsCheck:
    """Wraps the engine reset: marker, reset, flush probe, wait for the clear.

    `wrap(reset)` gives the reset call the canary (or the reset path) makes. Its first call is
    the reset the events witness judges; with the canary, its probes come after, and the canary's
    later resets pass straight through. `settle()` after a canary flushes the clear of the
    canary's last reset, so a case's first request meets an index that says empty.
    """

    events: KvEvents
    session: aiohttp.ClientSession
    base_url: str
    timeout_s: float  # one flush probe's bound
    api_key: str | None = field(default=None, repr=False)
    restart_seen: RestartSeen | None = None  # None: no counters, so no events-only restart counts
    clear_timeout_s: float = CLEAR_TIMEOUT_S
    report: WitnessReport | None = None
    calls: list[EngineCall] = field(default_factory=list)
    _judged: bool = False

    def wrap(self, reset: ResetCall) -> ResetCall:
        """The reset call with the events witness around its first use."""

        async def witnessed() -> CacheReset:
            if self._judged:
                return await reset()
            self._judged = True
            done, self.report = await self.judge(reset)
            return done

        return witnessed

    async def judge(self, reset: ResetCall) -> tuple[CacheReset, WitnessReport]:
        """Mark, reset, flush, and wait for the clear; the reset and the witness's report."""
        blocks_before = self.blocks()
        marker = self.events.mark()
        done = await reset()
        if not done.succeeded:
            why = "the engine did not accept the reset, so no clear was awaited"
            return done, events_report(
                None, blocks_before=blocks_before, flush=None, timeout_s=0, problem=why
            )
        flush = await self.flush()
        result = await self.events.cleared_since(marker, self.clear_timeout_s)
        seen = False
        if self.restart_seen is not None and any(r.restarted and not r.cleared for r in result.ranks):
            seen = await self.restart_seen(marker.wall)
        return done, events_report(
            result,
            blocks_before=blocks_before,
            flush=flush,
            timeout_s=self.clear_timeout_s,
            restart_seen=seen,
        )

    async def settle(self) -> None:
        """Flush the last reset's clear and wait for it (bounded); its outcome judges nothing."""
        marker = self.events.mark()
        await self.flush()
        await self.events.cleared_since(marker, self.clear_timeout_s)

    def blocks(self) -> int:
        """Live blocks over every rank and medium now."""
        return sum(sum(snap.blocks.values()) for snap in self.events.snapshots())

    async def flush(self) -> EngineCall:
        """The flush probe: one step of the engine, so it publishes the clear it holds back."""
        started = time.monotonic()
        body = {"prompt": FLUSH_PROMPT, "max_tokens": 1, "temperature": 0, "stream": False}
        reply = await engine_call(
            self.session,
            "POST",
            f"{self.base_url}/v1/completions",
            timeout_s=self.timeout_s,
            headers={"Content-Type": "application/json", **(bearer(self.api_key) or {})},
            body=orjson.dumps(body),
        )
        # Never the completion: the excerpt names the probe only.
        call = EngineCall(
            reply.call.method,
            reply.call.url,
            reply.call.status,
            orjson.dumps({"flush_probe": True}).decode(),
            time.monotonic() - started,
            reply.call.error,
        )
        self.calls.append(call)
        return call


def merged(mode: VerifyMode, canary: Verification, events: WitnessReport | None) -> Verification:
    """The reset's verification: every witness that ran under `verification.witnesses`, one `verified`."""
    witnesses: dict[str, dict[str, Any]] = {}
    reasons: dict[str, str] = {}
    results: dict[str, WitnessReport] = {}
    if canary.ran:
        witnesses["canary"] = {"result": canary.verified.value, **canary.to_json()}
        results["canary"] = WitnessReport(canary.verified, canary.reason)
        reasons["canary"] = canary.reason
    if events is not None:
        witnesses["events"] = events.to_json()
        results["events"] = events
        reasons["events"] = events.reason
    if not results:
        return canary
    reason = (
        next(iter(reasons.values()))
        if len(reasons) == 1
        else "; ".join(f"{k}: {r}" for k, r in reasons.items())
    )
    return replace(canary, method=mode, verified=combine(results), reason=reason, witnesses=witnesses)
