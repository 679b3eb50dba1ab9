"""The record of one observed exchange, as the evidence writer and the witness take it.

`Forwarded` and `Observation` are built once per request: NamedTuples, immutable as a frozen
dataclass is, built in a third of its time (a frozen dataclass sets each field through
`object.__setattr__`: 2.0 µs for an observation's 26 against 0.6, timeit, issue 50).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from proxy.observe.overhead import overhead_member
from proxy.vocabulary import EventType, IsolationResult, Outcome, ServedBy

__all__ = ["Forwarded", "IsolationMark", "Observation"]


class Forwarded(NamedTuple):
    """Transport facts of one forwarded exchange, observed or not (for metrics)."""

    method: str
    path: str
    status: int | None
    outcome: Outcome
    started_ns: int
    first_byte_ns: int | None
    finished_ns: int
    # Time the sidecar itself spent: request in → upstream request sent, and
    # upstream response head → client response head (None where not reached).
    before_upstream_s: float | None
    after_upstream_s: float | None
    served_by: ServedBy  # which HTTP server took the request
    bad_answer: bool = False  # the engine's answer broke HTTP or the leg's limits (502 upstream_bad_answer)
    # The sidecar's own added time (proxy/observe/overhead.py); None where not measured.
    added_in_us: int | None = None
    added_out_us: int | None = None


@dataclass(frozen=True, slots=True)
class IsolationMark:
    """An isolated request (proxy/isolation/): what its answer proved, and the member that isolated it."""

    result: IsolationResult
    field: str | None  # cache_salt, extra_key, cache_prompt; None when it was refused

    def to_json(self) -> dict[str, Any]:
        """The observation's `isolation` member."""
        return {"mode": "request", "result": self.result, "field": self.field}


class Observation(NamedTuple):
    """What the sidecar saw of one forwarded inference request (no prompt, text, key or user)."""

    request_id: str
    session_id: str | None
    case_id: str | None
    method: str
    path: str
    status: int | None
    stream: bool
    model: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    cached_tokens_source: str | None
    reset_id: str | None
    ordinal_since_reset: int | None
    started_ns: int
    first_byte_ns: int | None
    finished_ns: int
    outcome: Outcome
    usage_injected: bool
    # The engine's own id for the answer (its body's first `id`); the sidecar adds none.
    engine_request_id: str | None = None
    # Whether the request carried its reset's case token (X-Cachewitness-Case); never the token.
    case_token_carried: bool = False
    # Cached tokens per tier where the engine names them (proxy/observe/tiers.py); None otherwise.
    cached_by_tier: dict[str, int] | None = None
    isolation: IsolationMark | None = None  # None: the request was not isolated
    # The time the sidecar itself added (proxy/observe/overhead.py); None where not measured.
    added_in_us: int | None = None
    added_out_us: int | None = None

    def to_record(self) -> dict[str, Any]:
        """The `infer.cache_observation` evidence record (docs/evidence.md)."""
        return {
            "schema_version": 1,
            "event_type": str(EventType.CACHE_OBSERVATION),
            "at_ns": self.finished_ns,
            "request_id": self.request_id,
            "session_id": self.session_id,
            "case_id": self.case_id,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "stream": self.stream,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_tokens_source": self.cached_tokens_source,
            "reset_id": self.reset_id,
            "ordinal_since_reset": self.ordinal_since_reset,
            "started_ns": self.started_ns,
            "first_byte_ns": self.first_byte_ns,
            "finished_ns": self.finished_ns,
            "outcome": self.outcome,
            "usage_injected": self.usage_injected,
            "engine_request_id": self.engine_request_id,
            "case_token_carried": self.case_token_carried,
            "cached_by_tier": self.cached_by_tier,
            "isolation": self.isolation.to_json() if self.isolation is not None else None,
            "overhead": overhead_member(self.added_in_us, self.added_out_us),
        }
