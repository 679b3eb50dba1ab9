"""What an isolated case's requests proved, counted per case, and its `infer.cache_isolation` record."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from proxy.vocabulary import EventType, IsolationResult

__all__ = ["CaseTally", "CounterCheck", "request_result"]


def request_result(cached_tokens: int | None) -> IsolationResult:
    """What one isolated request's answer proved: 0 cached tokens is cold, more contradicts."""
    if cached_tokens is None:
        return IsolationResult.UNOBSERVABLE
    return IsolationResult.COLD if cached_tokens == 0 else IsolationResult.CONTRADICTED


@dataclass(frozen=True)
class CounterCheck:
    """The engine's own counters over an isolated case (read by the case witness at its end)."""

    engine: dict[str, int | None] | None  # the engine's deltas; None: its counters could not be read
    canary_cached_tokens: int
    other_requests: int  # requests in the case that were not isolated, or bypassed the sidecar
    reason: str

    @property
    def result(self) -> IsolationResult | None:
        """contradicted: the engine counted cached tokens beyond the canary's while only isolated
        traffic ran; cold: it counted none; None: the counters cannot tell (other traffic, no read)."""
        if self.engine is None or self.other_requests:
            return None
        cached = self.engine.get("cached_tokens")
        if cached is None:
            return None
        return (
            IsolationResult.CONTRADICTED if cached - self.canary_cached_tokens > 0 else IsolationResult.COLD
        )

    def to_json(self) -> dict[str, Any]:
        """The record's `counters` member."""
        result = self.result
        return {
            "engine": self.engine,
            "canary_cached_tokens": self.canary_cached_tokens,
            "other_requests": self.other_requests,
            "result": result.value if result is not None else "inconclusive",
            "reason": self.reason,
        }


@dataclass
class CaseTally:
    """The isolated requests of one case so far (session and case as the requests carried them)."""

    session_id: str | None
    case_id: str | None
    from_ns: int = field(default_factory=time.time_ns)
    last_at: float = field(default_factory=time.monotonic)
    counts: dict[IsolationResult, int] = field(default_factory=dict)

    def count(self, result: IsolationResult) -> None:
        """One more isolated request with this result."""
        self.counts[result] = self.counts.get(result, 0) + 1
        self.last_at = time.monotonic()

    @property
    def requests(self) -> int:
        """Isolated requests that reached the engine (refused ones never did)."""
        return sum(n for result, n in self.counts.items() if result != IsolationResult.REFUSED)

    def verdict(self, counters: CounterCheck | None = None) -> IsolationResult:
        """contradicted if one request or the engine's counters say so; else cold only if every request was."""
        get = self.counts.get
        if get(IsolationResult.CONTRADICTED, 0) or (
            counters is not None and counters.result == IsolationResult.CONTRADICTED
        ):
            return IsolationResult.CONTRADICTED
        if get(IsolationResult.UNOBSERVABLE, 0):
            return IsolationResult.UNOBSERVABLE
        return IsolationResult.COLD if self.requests else IsolationResult.EMPTY

    def summary(self, counters: CounterCheck | None = None) -> dict[str, Any]:
        """The counts and the verdict so far (`/cache/state`, and the record's body)."""
        get = self.counts.get
        return {
            "session_id": self.session_id,
            "case_id": self.case_id,
            "from_ns": self.from_ns,
            "requests": self.requests,
            "cold": get(IsolationResult.COLD, 0),
            "contradicted": get(IsolationResult.CONTRADICTED, 0),
            "unobservable": get(IsolationResult.UNOBSERVABLE, 0),
            "refused": get(IsolationResult.REFUSED, 0),
            "counters": counters.to_json() if counters is not None else None,
            "verdict": self.verdict(counters).value,
        }

    def to_record(self, closed_by: str, counters: CounterCheck | None) -> dict[str, Any]:
        """The `infer.cache_isolation` record (docs/evidence.md)."""
        return {
            "schema_version": 1,
            "event_type": str(EventType.CACHE_ISOLATION),
            "at_ns": time.time_ns(),
            **self.summary(counters),
            "closed_by": closed_by,
        }
