"""What an engine reset is made of: the attempt, the reset over its attempts, and the `Dialect` contract.

The reference benchmark client (stormlog `infer.cache_state`) reads a reset response's
`success` field; `CacheReset` keeps its fields and meanings so the sidecar is a drop-in reset
target, and adds the sidecar's own outcomes `unsupported`, `unreachable` and `error`, which
the reference words cannot say (its `answer` is then null). The HTTP call is in call.py, the
`infer.cache_state` record in proxy/evidence/records.py, the words in proxy/vocabulary.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import aiohttp

from proxy.engines.call import EngineCall, Reply
from proxy.engines.routes import NativeReset, RouteRule
from proxy.vocabulary import EngineKind, ResetAnswer

__all__ = [
    "HTTP_STATUS",
    "Attempt",
    "AttemptPlan",
    "CacheReset",
    "Dialect",
    "EngineInfo",
    "failed_attempt",
    "outcome_for_status",
    "success_field",
    "unsupported",
]

# The HTTP status of a `/cache/reset` answer by outcome (docs/reset.md).
HTTP_STATUS: dict[ResetAnswer, int] = {
    ResetAnswer.ACKNOWLEDGED: 200,
    ResetAnswer.ACCEPTED_UNVERIFIED: 200,
    ResetAnswer.REFUSED: 409,
    ResetAnswer.UNSUPPORTED: 501,
    ResetAnswer.UNREACHABLE: 502,
    ResetAnswer.ERROR: 502,
}

# The reference's `success` for its answers (None where the engine said nothing either way).
_REFERENCE_SUCCESS: dict[ResetAnswer, bool] = {ResetAnswer.ACKNOWLEDGED: True, ResetAnswer.REFUSED: False}


@dataclass(frozen=True)
class EngineInfo:
    """Which engine the sidecar fronts: its kind and version."""

    kind: EngineKind
    version: str | None = None
    # How this engine serves, where it differs from the kind's usual way (ENGINE_MODES in
    # proxy/engines/modes.py): vLLM's Rust front end, llama.cpp's router. Not in `to_json`.
    mode: str | None = None

    def to_json(self) -> dict[str, str | None]:
        """The `engine` block of answers and records."""
        return {"kind": str(self.kind), "version": self.version}


@dataclass(frozen=True)
class Attempt:
    """One reset attempt through a dialect: its outcome and every engine call it made."""

    outcome: ResetAnswer
    status: int | None = None
    success: bool | None = None
    error: str | None = None
    url: str = ""
    calls: tuple[EngineCall, ...] = ()
    hint: str | None = None
    warning: str | None = None
    # Tiers the engine said it cannot reset here (vLLM's Rust front end: no connector, no external tier).
    unsupported_tiers: tuple[str, ...] = ()


@dataclass(frozen=True)
class CacheReset:
    """The outcome of a cache reset over every attempt it took (the reference's fields, plus the sidecar's outcome).

    `at_ns` is when the first attempt was sent; `answered_at_ns` is when the last
    attempt's answer came back. `status`, `url`, `success` are the last attempt's.
    """

    url: str
    at_ns: int
    status: int | None = None
    error: str | None = None
    success: bool | None = None
    attempts: int = 1
    answered_at_ns: int | None = None
    outcome: ResetAnswer = ResetAnswer.ERROR
    calls: tuple[EngineCall, ...] = ()
    hint: str | None = None
    warning: str | None = None
    unsupported_tiers: tuple[str, ...] = ()

    @property
    def answer(self) -> ResetAnswer | None:
        """`acknowledged`, `refused` or `accepted_unverified` (the reference's words); None otherwise."""
        return self.outcome if self.outcome.is_reference else None

    @property
    def succeeded(self) -> bool:
        """The engine accepted the reset, whether or not it confirmed it."""
        return self.answer in (ResetAnswer.ACKNOWLEDGED, ResetAnswer.ACCEPTED_UNVERIFIED)

    @property
    def acknowledged(self) -> bool:
        """The engine said the reset happened."""
        return self.answer == ResetAnswer.ACKNOWLEDGED

    @property
    def http_status(self) -> int:
        """The status of the `/cache/reset` answer (docs/reset.md)."""
        return HTTP_STATUS[self.outcome]

    def to_record(self) -> dict[str, Any]:
        """The `reset` block of `infer.cache_state`: exactly the reference's keys and meanings.

        The reference reads `success` from a 2xx body only, so a reset the engine could not
        serve (unsupported, unreachable, error) records None there, not the answer's false.
        """
        return {
            "url": self.url,
            "at_ns": self.at_ns,
            "status": self.status,
            "error": self.error,
            "success": _REFERENCE_SUCCESS.get(self.answer) if self.answer is not None else None,
            "answer": str(self.answer) if self.answer is not None else None,
            "attempts": self.attempts,
            "answered_at_ns": self.answered_at_ns,
        }

    @classmethod
    def from_attempts(
        cls, last: Attempt, *, at_ns: int, attempts: int, calls: tuple[EngineCall, ...], answered_at_ns: int
    ) -> CacheReset:
        """Fold the last attempt into the reset's outcome, with the error worded as docs/evidence.md says."""
        error = last.error
        if last.outcome == ResetAnswer.REFUSED:
            error = f"refused: {last.error or 'refused'} on {attempts} attempts"
        elif last.outcome in (ResetAnswer.UNSUPPORTED, ResetAnswer.UNREACHABLE, ResetAnswer.ERROR):
            error = f"{last.outcome}: {last.error or 'no detail'}"
        return cls(
            url=last.url,
            at_ns=at_ns,
            status=last.status,
            error=error,
            success=_success_for(last),
            attempts=attempts,
            answered_at_ns=answered_at_ns,
            outcome=last.outcome,
            calls=calls,
            hint=last.hint,
            warning=last.warning,
            unsupported_tiers=last.unsupported_tiers,
        )


def _success_for(attempt: Attempt) -> bool | None:
    """True only for an acknowledgement, None for a 2xx that did not say, else False (the answer's `success`)."""
    if attempt.outcome == ResetAnswer.ACKNOWLEDGED:
        return True
    if attempt.outcome == ResetAnswer.ACCEPTED_UNVERIFIED:
        return None
    return False


def success_field(payload: Any, name: str = "success") -> bool | None:
    """vLLM's `{"success": bool}`: True only for `true`, False for any other value, None without the field."""
    if not isinstance(payload, dict) or name not in payload:
        return None
    return payload[name] is True


def outcome_for_status(status: int) -> tuple[ResetAnswer, str]:
    """The outcome of a non-2xx answer no dialect rule claimed, and what to say: 5xx and other 4xx are errors."""
    if status >= 500:
        return ResetAnswer.ERROR, f"HTTP {status} from the engine"
    return ResetAnswer.ERROR, f"HTTP {status}: the engine rejected the reset call"


def failed_attempt(reply: Reply, url: str) -> Attempt:
    """The attempt when a call got no HTTP response at all: the engine is unreachable."""
    return Attempt(ResetAnswer.UNREACHABLE, error=reply.call.error, url=url, calls=(reply.call,))


@dataclass(frozen=True)
class AttemptPlan:
    """What one reset attempt is asked to do, and in how much time."""

    base_url: str
    force: bool = False
    retry_seconds: float = 0.0  # what is left of the retry window when the attempt starts
    timeout_s: float = 30.0  # the longest one engine call may take (reset_attempt_timeout)


class Dialect(ABC):
    """How one engine kind is reset; dialects are leaves that know nothing of the proxy."""

    kind: ClassVar[EngineKind]
    health_path: str = "/health"
    # The engine's control routes (admin only through the sidecar) and its own reset route
    # (intercepted). Empty for engines the sidecar does not know: the policy then covers
    # every known engine's routes (proxy/admin/policy.py).
    control_routes: ClassVar[tuple[RouteRule, ...]] = ()
    native_reset: ClassVar[NativeReset | None] = None
    # A 2xx that says nothing may hide a refusal (vLLM's Rust front end drops the engine's no):
    # a canary that then finds the cache warm asks for another try (proxy/reset/silent.py).
    silent_refusals: ClassVar[bool] = False

    @abstractmethod
    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """One reset attempt; never raises."""


def unsupported(url: str, error: str, hint: str, calls: tuple[EngineCall, ...] = ()) -> Attempt:
    """An attempt the engine cannot serve, with how to switch the reset on."""
    return Attempt(
        ResetAnswer.UNSUPPORTED,
        error=error,
        url=url,
        calls=calls,
        hint=hint,
        status=calls[-1].status if calls else None,
    )
