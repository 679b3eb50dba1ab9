"""Reset sequences, request ordinals, traffic verdicts (docs/evidence.md) and the counters behind /cache/state.

The traffic verdict is the second witness of a reset, after the canary (proxy/witnesses/canary.py): the
first request after a reset that answers with a cached-token count decides it. A cached answer
contradicts the reset only when that request had the engine to itself until its first byte;
when another request after the same reset reached the engine first, the engine may have run
that one first and filled the cache, so the verdict is `inconclusive`.

Each reset has a `case_token` (random); requests carrying it (`X-Cachewitness-Case`) are the
reset's own traffic. A reset that `bind`s its verdict lets only them decide it, and when any
other request reached the engine before the deciding one's first byte, that other request may
have filled or emptied the cache in between: the verdict is `inconclusive`, never `consistent`.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from proxy.observe import Observation
from proxy.observe.overhead import OverheadQuantiles
from proxy.vocabulary import EventType, Outcome, Verdict, Verified

__all__ = ["WITNESS", "Witness"]


# Start times are kept for the first ordinals only: a candidate further on always has an
# earlier request of its reset before it, so it is inconclusive whatever the times say.
_TIMED_ORDINALS = 64


@dataclass(frozen=True)
class _Sequence:
    """The accepted reset that numbers the requests after it."""

    reset_id: str
    session_id: str | None
    case_id: str | None
    at_ns: int
    verified: Verified
    case_token: str | None = None
    bind: bool = False


@dataclass(frozen=True)
class _Candidate:
    """A finished request that could decide the verdict once nothing lower is in flight."""

    ordinal: int
    verdict: Verdict
    request_id: str
    cached_tokens: int | None


@dataclass(frozen=True)
class TrafficVerdict:
    """The request that settled a reset's traffic verdict: an `infer.cache_verification` record."""

    reset_id: str
    session_id: str | None
    case_id: str | None
    verdict: Verdict
    request_id: str
    cached_tokens: int | None
    at_ns: int
    bind: bool = False

    def to_record(self) -> dict[str, Any]:
        """The evidence record (docs/evidence.md)."""
        return {
            "schema_version": 1,
            "event_type": str(EventType.CACHE_VERIFICATION),
            "at_ns": self.at_ns,
            "reset_id": self.reset_id,
            "session_id": self.session_id,
            "case_id": self.case_id,
            "verdict": self.verdict.value,
            "request_id": self.request_id,
            "cached_tokens": self.cached_tokens,
            "bind": self.bind,
        }


@dataclass(frozen=True)
class ResetSummary:
    """What the witness is told once per engine reset (the `last_reset` of /cache/state)."""

    reset_id: str
    answer: str
    verified: str
    verification: dict[str, Any]
    reference_answer: str | None
    succeeded: bool
    acknowledged: bool
    engine: dict[str, Any]
    attempts: int
    status: int | None
    url: str | None
    error: str | None
    hint: str | None
    warning: str | None
    at_ns: int
    answered_at_ns: int | None
    duration_s: float
    drain: dict[str, Any]
    session_id: str | None
    case_id: str | None
    callers: tuple[dict[str, str | None], ...]
    cache_state: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The JSON shape /cache/state shows."""
        return {**asdict(self), "callers": list(self.callers)}


def _decides(obs: Observation) -> bool:
    """A request decides only when the exchange completed with a 2xx answer."""
    return obs.outcome == Outcome.OK and obs.status is not None and 200 <= obs.status < 300


class Witness:
    """Numbers inference requests after each accepted reset and settles its verdict.

    Memory is bounded: the ordinals still in flight (at most the concurrency)
    and the lowest finished candidate — never the observations themselves.
    Every `begin_request()` must end in `observe()` or `abandon()`, or the
    verdict waits for it.
    """

    def __init__(self) -> None:
        """No reset seen yet: requests are unnumbered, counters run from start."""
        self._sequence: _Sequence | None = None
        self._next_ordinal = 1
        self._in_flight: set[int] = set()
        self._best: _Candidate | None = None
        self._verdict = Verdict.PENDING
        self._decided: _Candidate | None = None
        self._last_reset: ResetSummary | None = None
        # Ordinal → when it reached the engine (time.time_ns()), while the verdict is pending.
        self._started: dict[int, int] = {}
        # With `bind`: the first request without the case token, (ordinal, when it reached the engine).
        self._first_foreign: tuple[int, int] | None = None
        # The counter witness's part of /cache/state (proxy/witnesses/case.py), given the reset_id.
        self.case_state: Callable[[str | None], dict[str, Any]] | None = None
        self._revised_reason: str | None = None
        self._reset_counters()

    def sequence_ids(self) -> tuple[str | None, str | None, str | None]:
        """(reset_id, session_id, case_id) of the current sequence (all None before any reset)."""
        sequence = self._sequence
        if sequence is None:
            return None, None, None
        return sequence.reset_id, sequence.session_id, sequence.case_id

    def revise(self, reset_id: str | None, verdict: Verdict, reason: str) -> None:
        """The counter witness saw traffic the sidecar did not (or a restart): the verdict can only get weaker."""
        if reset_id is None or not self._current(reset_id) or self._verdict == Verdict.CONTRADICTED:
            return
        if verdict == Verdict.INCONCLUSIVE and self._verdict == Verdict.UNOBSERVABLE:
            return
        self._verdict = verdict
        self._revised_reason = reason

    def _reset_counters(self) -> None:
        """Zero the counters since the reset."""
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.cached_tokens_unknown = 0
        self._ratio_prompt = 0
        self._ratio_cached = 0
        self._overhead = OverheadQuantiles()  # the sidecar's added time over the case

    def carries_token(self, header: str | None) -> bool:
        """Whether an `X-Cachewitness-Case` value is the current reset's case token (constant time)."""
        sequence = self._sequence
        if header is None or sequence is None or sequence.case_token is None:
            return False
        return hmac.compare_digest(
            header.encode("utf-8", "surrogateescape"), sequence.case_token.encode("ascii")
        )

    def begin_request(self, now_ns: int | None = None, *, own: bool = False) -> tuple[str | None, int | None]:
        """(reset_id, ordinal_since_reset) for a request about to reach the engine; (None, None) before any reset.

        `own`: the request carries the reset's case token. Every request is numbered; with
        `bind` only the reset's own ones can decide, so only they are waited for.
        """
        sequence = self._sequence
        if sequence is None:
            return None, None
        ordinal = self._next_ordinal
        self._next_ordinal += 1
        if self._verdict == Verdict.PENDING:
            start = time.time_ns() if now_ns is None else now_ns
            if sequence.bind and not own:
                if self._first_foreign is None:
                    self._first_foreign = (ordinal, start)
            else:
                self._in_flight.add(ordinal)
            if ordinal <= _TIMED_ORDINALS:
                self._started[ordinal] = start
        return sequence.reset_id, ordinal

    def unobserved(self, *, own: bool, now_ns: int | None = None) -> None:
        """An inference request reaching the engine unobserved: it gets no ordinal, but with `bind`
        and no token it is foreign traffic ahead of every request numbered after it."""
        sequence = self._sequence
        if sequence is None or not sequence.bind or own or self._verdict != Verdict.PENDING:
            return
        if self._first_foreign is None:
            self._first_foreign = (self._next_ordinal, time.time_ns() if now_ns is None else now_ns)

    def reset_accepted(
        self,
        *,
        reset_id: str,
        session_id: str | None,
        case_id: str | None,
        at_ns: int,
        verified: Verified = Verified.UNVERIFIED,
        case_token: str | None = None,
        bind: bool = False,
    ) -> None:
        """Start a new sequence (acknowledged or accepted_unverified resets only).

        Coalesced callers share one reset_id: a repeat of the current one keeps
        the sequence (and the first caller's session, case, token and bind).
        """
        if self._sequence is not None and self._sequence.reset_id == reset_id:
            return
        self._sequence = _Sequence(reset_id, session_id, case_id, at_ns, verified, case_token, bind)
        self._next_ordinal = 1
        self._in_flight = set()
        self._started = {}
        self._first_foreign = None
        self._best = None
        self._verdict = Verdict.PENDING
        self._decided = None
        self._revised_reason = None
        self._reset_counters()

    def reset_answered(self, summary: ResetSummary) -> None:
        """Remember any reset's answer as the last reset shown by /cache/state."""
        self._last_reset = summary

    def abandon(self, reset_id: str | None, ordinal: int | None) -> None:
        """A begun request that will never be observed: stop waiting for it."""
        if self._current(reset_id) and ordinal is not None:
            self._in_flight.discard(ordinal)
            self._settle()

    def observe(self, obs: Observation) -> TrafficVerdict | None:
        """Count one finished request; return the traffic verdict if it settles it."""
        if not self._current(obs.reset_id):
            return None  # a late request of an earlier sequence decides nothing now
        self._count(obs)
        if self._verdict != Verdict.PENDING or obs.ordinal_since_reset is None:
            return None
        self._in_flight.discard(obs.ordinal_since_reset)
        if self._may_decide(obs) and (self._best is None or obs.ordinal_since_reset < self._best.ordinal):
            self._best = _Candidate(
                obs.ordinal_since_reset, self._verdict_of(obs), obs.request_id, obs.cached_tokens
            )
        return self._settle()

    def _may_decide(self, obs: Observation) -> bool:
        """A completed 2xx exchange; with `bind`, one of the reset's own (it carried the case token)."""
        sequence = self._sequence
        own = obs.case_token_carried or (sequence is not None and not sequence.bind)
        return own and _decides(obs)

    def _verdict_of(self, obs: Observation) -> Verdict:
        """What one deciding request says of its reset."""
        if obs.cached_tokens is None:
            return Verdict.UNOBSERVABLE
        if self._foreign_before(obs):
            return Verdict.INCONCLUSIVE
        if obs.cached_tokens == 0:
            return Verdict.CONSISTENT
        return Verdict.INCONCLUSIVE if self._had_company(obs) else Verdict.CONTRADICTED

    def _had_company(self, obs: Observation) -> bool:
        """Whether another request after the same reset reached the engine before this one's first byte."""
        ordinal = obs.ordinal_since_reset
        assert ordinal is not None
        if ordinal > 1:
            return True  # the earlier ordinals reached the engine before it
        # Ordinals are given in the order requests reach the engine: the next one is the earliest other.
        next_start = self._started.get(ordinal + 1)
        first_byte = obs.first_byte_ns if obs.first_byte_ns is not None else obs.finished_ns
        return next_start is not None and next_start < first_byte

    def _foreign_before(self, obs: Observation) -> bool:
        """With `bind`: whether a request without the case token reached the engine before this one's first byte."""
        foreign = self._first_foreign
        if foreign is None:
            return False
        ordinal, started = foreign
        assert obs.ordinal_since_reset is not None
        first_byte = obs.first_byte_ns if obs.first_byte_ns is not None else obs.finished_ns
        return ordinal < obs.ordinal_since_reset or started < first_byte

    def _current(self, reset_id: str | None) -> bool:
        """Whether an observation belongs to the current sequence (or both are before any reset)."""
        current = self._sequence.reset_id if self._sequence is not None else None
        return reset_id == current

    def _count(self, obs: Observation) -> None:
        """Add one observation to the counters since the reset."""
        self.requests += 1
        self._overhead.add(obs.added_in_us, obs.added_out_us)
        if obs.prompt_tokens is not None:
            self.prompt_tokens += obs.prompt_tokens
        if obs.cached_tokens is not None:
            self.cached_tokens += obs.cached_tokens
        elif _decides(obs):
            self.cached_tokens_unknown += 1
        if obs.prompt_tokens is not None and obs.cached_tokens is not None:
            self._ratio_prompt += obs.prompt_tokens
            self._ratio_cached += obs.cached_tokens

    def _settle(self) -> TrafficVerdict | None:
        """Decide when the lowest candidate has no lower ordinal still in flight."""
        best = self._best
        if best is None or self._sequence is None:
            return None
        if any(ordinal < best.ordinal for ordinal in self._in_flight):
            return None
        self._verdict = best.verdict
        self._decided = best
        self._best = None
        self._in_flight = set()
        self._started = {}
        self._first_foreign = None
        sequence = self._sequence
        return TrafficVerdict(
            sequence.reset_id,
            sequence.session_id,
            sequence.case_id,
            best.verdict,
            best.request_id,
            best.cached_tokens,
            time.time_ns(),
            sequence.bind,
        )

    @property
    def verdict(self) -> Verdict:
        """The current sequence's traffic verdict (`pending` until known, and before any reset)."""
        return self._verdict

    def state(self) -> dict[str, Any]:
        """The body of GET /cache/state; the caller fills `engine`."""
        sequence = self._sequence
        decided = self._decided
        case = self.case_state(sequence.reset_id if sequence else None) if self.case_state else {}
        return {
            **case,
            "verdict_reason": self._revised_reason,
            "last_reset": self._last_reset.to_json() if self._last_reset else None,
            # The verdict belongs to the last ACCEPTED reset, which a later refused
            # reset does not replace: `reset_id` says which one it is.
            "reset_id": sequence.reset_id if sequence else None,
            "session_id": sequence.session_id if sequence else None,
            "case_id": sequence.case_id if sequence else None,
            "reset_at_ns": sequence.at_ns if sequence else None,
            # Two witnesses of the last accepted reset: its canary, and the traffic after it.
            "verified": sequence.verified.value if sequence else None,
            "bind": sequence.bind if sequence else None,
            "verdict": self._verdict.value,
            "verdict_request_id": decided.request_id if decided else None,
            "verdict_cached_tokens": decided.cached_tokens if decided else None,
            "since_reset": {
                "requests": self.requests,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "cached_tokens_unknown": self.cached_tokens_unknown,
                # Over the requests that reported both numbers.
                "hit_ratio": (self._ratio_cached / self._ratio_prompt) if self._ratio_prompt else None,
                # What the sidecar itself added to these requests (p50/p99, microseconds).
                "overhead": self._overhead.to_json(),
            },
            "engine": None,
        }


WITNESS = web.AppKey("witness", Witness)
