"""The counter witness: the engine's own totals reconciled with what the sidecar saw (docs/evidence.md).

Between two reads of the engine's counters (a reset, a case end), every request the engine served
was the canary's, one the sidecar observed, one the sidecar forwarded unobserved (past the body
budget, counted), or traffic that went straight to the engine's port: engine delta − canary −
observed − unobserved = bypass. Pure: the reads come from proxy/witnesses/case.py.

A counter that went down means the engine restarted in between (its counters start at 0): the
delta is then unknown, and the reconciliation says `restarted` instead of a bypass.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from proxy.engines.counters import Totals
from proxy.vocabulary import EventType

__all__ = ["CaseVerdict", "Reconciliation", "Sums", "reconcile"]


class CaseVerdict(StrEnum):
    """What a case's reconciliation says of its traffic verdict."""

    CONSISTENT = "consistent"  # nothing but what the sidecar saw reached the engine
    CONTRADICTED = "contradicted"  # traffic the sidecar did not see hit the cache
    INCONCLUSIVE = "inconclusive"  # unseen traffic without cached tokens, a restart inside, or no counters
    COLD_BY_RESTART = "cold_by_restart"  # the engine restarted before the case's first request


@dataclass(frozen=True)
class Sums:
    """Requests and tokens of one kind of traffic."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def plus(self, prompt: int | None, cached: int | None) -> Sums:
        """One more request with its numbers (an unreported number adds 0)."""
        return Sums(self.requests + 1, self.prompt_tokens + (prompt or 0), self.cached_tokens + (cached or 0))

    def add(self, other: Sums) -> Sums:
        """Both together."""
        return Sums(
            self.requests + other.requests,
            self.prompt_tokens + other.prompt_tokens,
            self.cached_tokens + other.cached_tokens,
        )

    def to_json(self) -> dict[str, int]:
        """`{requests, prompt_tokens, cached_tokens}`."""
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
        }


@dataclass(frozen=True)
class Reconciliation:
    """One `infer.cache_reconciliation` record: a reset sequence's counters, from read to read."""

    reset_id: str | None
    session_id: str | None
    case_id: str | None
    engine_kind: str
    closed_by: str  # reset | close | idle
    from_ns: int
    at_ns: int
    engine: dict[str, int | None] | None  # the engine's deltas; None when unknown
    observed: Sums
    unobserved: Sums
    canary: Sums
    bypass: dict[str, int | None] | None
    in_flight_at_read: int
    restarted: bool
    verdict: CaseVerdict
    reason: str

    def to_record(self) -> dict[str, Any]:
        """The evidence record (docs/evidence.md)."""
        return {
            "schema_version": 1,
            "event_type": str(EventType.CACHE_RECONCILIATION),
            "at_ns": self.at_ns,
            "from_ns": self.from_ns,
            "reset_id": self.reset_id,
            "session_id": self.session_id,
            "case_id": self.case_id,
            "engine_kind": self.engine_kind,
            "closed_by": self.closed_by,
            "engine": self.engine,
            "observed": self.observed.to_json(),
            "unobserved": self.unobserved.to_json(),
            "canary": self.canary.to_json(),
            "bypass": self.bypass,
            "in_flight_at_read": self.in_flight_at_read,
            "restarted": self.restarted,
            "verdict": self.verdict.value,
            "reason": self.reason,
        }


def _delta(after: int | None, before: int | None) -> int | None:
    """after − before, None when either is unknown."""
    return None if after is None or before is None else after - before


def reconcile(
    before: Totals | None,
    after: Totals | None,
    *,
    seen: Sums,
    canary: Sums,
    in_flight_at_read: int,
    restart_seen: str | None,
    restart_before_traffic: bool,
) -> tuple[dict[str, int | None] | None, dict[str, int | None] | None, bool, CaseVerdict, str]:
    """(engine deltas, bypass, restarted, verdict, reason) of one sequence.

    `seen` is everything the sidecar saw reach the engine (observed and unobserved); `restart_seen`
    says how a restart in between was seen (None: none was), `restart_before_traffic` that it came
    before the sequence's first request.
    """
    if before is None or after is None:
        return (
            None,
            None,
            restart_seen is not None,
            CaseVerdict.INCONCLUSIVE,
            "the engine's counters could not be read",
        )
    deltas = {
        "requests": _delta(after.requests, before.requests),
        "prompt_tokens": _delta(after.prompt_tokens, before.prompt_tokens),
        "cached_tokens": _delta(after.cached_tokens, before.cached_tokens),
    }
    went_down = any(value is not None and value < 0 for value in deltas.values())
    if restart_seen is not None or went_down:
        if restart_before_traffic:
            return (
                None,
                None,
                True,
                CaseVerdict.COLD_BY_RESTART,
                "the engine restarted before the case's traffic",
            )
        how = restart_seen or "a counter went down"
        return None, None, True, CaseVerdict.INCONCLUSIVE, f"the engine restarted inside the case ({how})"
    known = seen.add(canary)
    bypass = {
        "requests": _delta(deltas["requests"], known.requests),
        "prompt_tokens": _delta(deltas["prompt_tokens"], known.prompt_tokens),
        "cached_tokens": _delta(deltas["cached_tokens"], known.cached_tokens),
    }
    verdict, reason = _judge(bypass, in_flight_at_read)
    return deltas, bypass, False, verdict, reason


def _judge(bypass: dict[str, int | None], in_flight: int) -> tuple[CaseVerdict, str]:
    """The case's verdict from its bypass."""
    requests, cached = bypass["requests"], bypass["cached_tokens"]
    if cached is not None and cached > 0:
        return CaseVerdict.CONTRADICTED, (
            f"traffic the sidecar did not see reached the engine and hit its cache "
            f"({requests if requests is not None else 'unknown'} requests, {cached} cached tokens)"
        )
    if (requests is not None and requests > 0) or (bypass["prompt_tokens"] or 0) > 0:
        return CaseVerdict.INCONCLUSIVE, (
            f"traffic the sidecar did not see reached the engine ({requests if requests is not None else 'unknown'}"
            " requests), without cached tokens"
        )
    if any(value is not None and value < 0 for value in bypass.values()):
        # The engine counted less than the sidecar saw: a request still in flight at a read.
        return CaseVerdict.INCONCLUSIVE, (
            f"the engine's counters lag what the sidecar saw ({in_flight} requests in flight at the read)"
        )
    return CaseVerdict.CONSISTENT, "the engine served only what the sidecar saw"
