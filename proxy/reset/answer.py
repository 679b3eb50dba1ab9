"""The answers of a reset round: each caller's JSON answer and record, and the witness's summary.

A round is one engine reset and the callers who share it (the service coalesces them); these
are pure functions of the round and of what it found (docs/reset.md has the answer's fields).
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any

from proxy.engines.base import CacheReset, EngineInfo
from proxy.engines.call import EngineCall
from proxy.evidence.records import cache_state_record
from proxy.reset.params import ResetParams
from proxy.vocabulary import ResetAnswer
from proxy.witnesses.traffic import ResetSummary
from proxy.witnesses.verification import Verification, answer_of, record_with

__all__ = ["Caller", "Round", "RoundOutcome", "answer_all", "caller_answer", "reset_summary"]

# An answer lists every engine call, but a long retry window against llama.cpp makes hundreds:
# keep the first and the last ones and say how many were left out.
_CALLS_HEAD = 16
_CALLS_TAIL = 48


def _calls_json(calls: tuple[EngineCall, ...]) -> tuple[list[dict[str, Any]], int]:
    """The answer's calls list, bounded, and how many calls it leaves out."""
    if len(calls) <= _CALLS_HEAD + _CALLS_TAIL:
        return [call.to_json() for call in calls], 0
    kept = calls[:_CALLS_HEAD] + calls[-_CALLS_TAIL:]
    return [call.to_json() for call in kept], len(calls) - len(kept)


@dataclass
class Caller:
    """One `/cache/reset` call waiting for its answer."""

    params: ResetParams
    answer: asyncio.Future[tuple[int, dict[str, Any]]]


@dataclass
class Round:
    """One engine reset and the callers who share it; it runs with the first caller's parameters."""

    callers: list[Caller]
    reset_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Requests carrying it (X-Cachewitness-Case) are this reset's own traffic; only the
    # callers' answers show it, never a record or a log.
    case_token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)

    @property
    def params(self) -> ResetParams:
        """The parameters the engine reset runs with."""
        return self.callers[0].params


@dataclass(frozen=True)
class RoundOutcome:
    """What a round found: the reset, the engine, and the drain."""

    reset: CacheReset
    engine: EngineInfo
    drain: dict[str, Any]
    verification: Verification


def caller_answer(
    params: ResetParams, current: Round, outcome: RoundOutcome, index: int
) -> tuple[int, dict[str, Any]]:
    """One caller's answer (docs/reset.md) with its own `infer.cache_state` record."""
    reset, verification = outcome.reset, outcome.verification
    record = cache_state_record(
        session_id=params.session_id,
        case_id=params.case_id,
        requested=params.requested,
        reset=reset,
        warmup_requests=params.warmup_requests,
        reset_id=current.reset_id,
        engine=outcome.engine,
        via=params.via,
    )
    if params.parent_reset_id is not None:
        record["parent_reset_id"] = params.parent_reset_id
    record = record_with(record, reset, verification)
    answer, status = answer_of(reset, verification)
    body: dict[str, Any] = {}
    if answer != ResetAnswer.ACCEPTED_UNVERIFIED:
        # Absent, not null, when unconfirmed: a client reading `success` must see no field.
        body["success"] = answer == ResetAnswer.ACKNOWLEDGED
    calls, omitted = _calls_json(reset.calls)
    body.update(
        {
            "answer": answer,
            "verified": verification.verified.value,
            "verification": verification.to_json(),
            "reset_id": current.reset_id,
            "engine": outcome.engine.to_json(),
            "attempts": reset.attempts,
            "at_ns": reset.at_ns,
            "answered_at_ns": reset.answered_at_ns,
            "status": reset.status,
            "url": reset.url,
            "drain": outcome.drain,
            "calls": calls,
            "session_id": params.session_id,
            "case_id": params.case_id,
            "coalesced": index > 0,
            "parent_reset_id": params.parent_reset_id,
            # Only a reset that started a new sequence has traffic of its own to name.
            "case_token": current.case_token if reset.succeeded else None,
            "bind": current.params.bind if reset.succeeded else None,
            # The case's requests isolated until its next reset (proxy/isolation/), whatever the reset's answer.
            "isolation": params.isolation.value,
            "cache_state": record,
        }
    )
    if omitted:
        body["calls_omitted"] = omitted
    if reset.error:
        body["detail"] = reset.error
    hint = verification.hint or reset.hint
    if hint:
        body["hint"] = hint
    if reset.warning:
        body["warning"] = reset.warning
    return status, body


def reset_summary(current: Round, outcome: RoundOutcome, first_record: dict[str, Any]) -> ResetSummary:
    """What the witness is told once per engine reset."""
    reset = outcome.reset
    answered = reset.answered_at_ns or reset.at_ns
    return ResetSummary(
        reset_id=current.reset_id,
        answer=answer_of(reset, outcome.verification)[0],
        verified=outcome.verification.verified.value,
        verification=outcome.verification.to_json(),
        reference_answer=reset.answer,
        succeeded=reset.succeeded,
        acknowledged=reset.acknowledged,
        engine=outcome.engine.to_json(),
        attempts=reset.attempts,
        status=reset.status,
        url=reset.url,
        error=reset.error,
        hint=reset.hint,
        warning=reset.warning,
        at_ns=reset.at_ns,
        answered_at_ns=reset.answered_at_ns,
        duration_s=max(0, answered - reset.at_ns) / 1e9,
        drain=outcome.drain,
        session_id=current.params.session_id,
        case_id=current.params.case_id,
        callers=tuple(
            {"session_id": c.params.session_id, "case_id": c.params.case_id} for c in current.callers
        ),
        cache_state=first_record,
    )


def answer_all(current: Round, status: int, body: dict[str, Any]) -> None:
    """Give every caller of a round the same answer."""
    for caller in current.callers:
        if not caller.answer.done():
            caller.answer.set_result((status, body))
