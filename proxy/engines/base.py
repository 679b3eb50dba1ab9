"""Shared outcome types of an engine reset, the `infer.cache_state` record, and the `Dialect` contract.

The reference benchmark client (stormlog `infer.cache_state`) reads a reset answer's
`success` field and writes a record per case; `CacheReset`, `run_kind` and
`cache_state_record` reproduce its shape and wording exactly so the sidecar is a
drop-in reset target. The sidecar's own outcome adds `unsupported`, `unreachable`
and `error`, which the reference words cannot say (its `answer` is then null).
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

import aiohttp

from proxy.engines.routes import NativeReset, RouteRule
from proxy.redact import redact_url
from proxy.upstream.resend import send_upstream

__all__ = [
    "ACCEPTED_UNVERIFIED",
    "ACKNOWLEDGED",
    "BODY_EXCERPT_BYTES",
    "COLD",
    "ERROR",
    "HTTP_STATUS",
    "OUTCOMES",
    "REFERENCE_ANSWERS",
    "REFUSED",
    "UNREACHABLE",
    "UNSPECIFIED",
    "UNSUPPORTED",
    "UNVERIFIED",
    "Attempt",
    "AttemptPlan",
    "CacheReset",
    "Dialect",
    "EngineCall",
    "EngineInfo",
    "EngineKind",
    "Reply",
    "ResetAnswer",
    "Via",
    "bearer",
    "cache_state_record",
    "engine_call",
    "failed_attempt",
    "outcome_for_status",
    "run_kind",
    "success_field",
    "unsupported",
]


class ResetAnswer(StrEnum):
    """What became of an engine reset: the reference client's three words, then the sidecar's own."""

    ACKNOWLEDGED = "acknowledged"
    ACCEPTED_UNVERIFIED = "accepted_unverified"
    REFUSED = "refused"
    UNSUPPORTED = "unsupported"
    UNREACHABLE = "unreachable"
    ERROR = "error"


class EngineKind(StrEnum):
    """The engines the sidecar knows; `unknown` while `--engine auto` has not reached the upstream."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    MINDNANO = "mindnano"
    GENERIC = "generic"
    NONE = "none"
    UNKNOWN = "unknown"


# The reference client's words (stormlog infer.cache_state).
UNSPECIFIED = "unspecified"
COLD = "cold"
UNVERIFIED = "unverified"
# Short names for the answers, as the dialect modules use them.
ACKNOWLEDGED = ResetAnswer.ACKNOWLEDGED
REFUSED = ResetAnswer.REFUSED
ACCEPTED_UNVERIFIED = ResetAnswer.ACCEPTED_UNVERIFIED
UNSUPPORTED = ResetAnswer.UNSUPPORTED
UNREACHABLE = ResetAnswer.UNREACHABLE
ERROR = ResetAnswer.ERROR
REFERENCE_ANSWERS = (ACKNOWLEDGED, REFUSED, ACCEPTED_UNVERIFIED)
OUTCOMES = tuple(ResetAnswer)
# SPEC §4: the HTTP status of a `/cache/reset` answer by outcome.
HTTP_STATUS: dict[str, int] = {
    ACKNOWLEDGED: 200,
    ACCEPTED_UNVERIFIED: 200,
    REFUSED: 409,
    UNSUPPORTED: 501,
    UNREACHABLE: 502,
    ERROR: 502,
}

# The reference's `success` for its answers (None where the engine said nothing either way).
_REFERENCE_SUCCESS: dict[str, bool] = {ACKNOWLEDGED: True, REFUSED: False}


class Via(StrEnum):
    """How a reset reached the sidecar (the `via` of `infer.cache_state`)."""

    API = "api"  # POST /cache/reset
    NATIVE = "native"  # the engine's own reset route, called through the sidecar
    CLUSTER = "cluster"  # a cluster-scope reset's own record (proxy/cluster/fanout.py)


BODY_EXCERPT_BYTES = 2048
# How much of an engine's answer is read at all (the reference reads 64 KiB).
_BODY_READ_LIMIT = 64 * 1024


@dataclass(frozen=True)
class EngineInfo:
    """Which engine the sidecar fronts: `kind` (vllm, sglang, llamacpp, mindnano, generic, none, unknown) and its version."""

    kind: str
    version: str | None = None

    def to_json(self) -> dict[str, str | None]:
        """The `engine` block of answers and records."""
        return {"kind": self.kind, "version": self.version}


@dataclass(frozen=True)
class EngineCall:
    """One HTTP call made to the engine: URL redacted, body bounded."""

    method: str
    url: str
    status: int | None
    body_excerpt: str
    elapsed_s: float
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The entry of an answer's `calls` list."""
        return {
            "method": self.method,
            "url": self.url,
            "status": self.status,
            "body_excerpt": self.body_excerpt,
            "elapsed_s": round(self.elapsed_s, 6),
            "error": self.error,
        }


@dataclass(frozen=True)
class Reply:
    """What one engine call produced: its record, the body read (bounded), and whether it timed out."""

    call: EngineCall
    body: bytes = b""
    timed_out: bool = False

    @property
    def status(self) -> int | None:
        """The HTTP status, None when no answer came."""
        return self.call.status

    def json(self) -> Any:
        """The body as JSON, None when it is empty or not JSON."""
        try:
            return json.loads(self.body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return None


@dataclass(frozen=True)
class Attempt:
    """One reset attempt through a dialect: its outcome and every engine call it made."""

    outcome: str
    status: int | None = None
    success: bool | None = None
    error: str | None = None
    url: str = ""
    calls: tuple[EngineCall, ...] = ()
    hint: str | None = None
    warning: str | None = None


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
    outcome: str = ERROR
    calls: tuple[EngineCall, ...] = ()
    hint: str | None = None
    warning: str | None = None

    @property
    def answer(self) -> str | None:
        """`acknowledged`, `refused` or `accepted_unverified` (the reference's words); None otherwise."""
        return self.outcome if self.outcome in REFERENCE_ANSWERS else None

    @property
    def succeeded(self) -> bool:
        """The engine accepted the reset, whether or not it confirmed it."""
        return self.answer in (ACKNOWLEDGED, ACCEPTED_UNVERIFIED)

    @property
    def acknowledged(self) -> bool:
        """The engine said the reset happened."""
        return self.answer == ACKNOWLEDGED

    @property
    def http_status(self) -> int:
        """The status of the `/cache/reset` answer (SPEC §4)."""
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
            "success": _REFERENCE_SUCCESS.get(self.answer or ""),
            "answer": self.answer,
            "attempts": self.attempts,
            "answered_at_ns": self.answered_at_ns,
        }

    @classmethod
    def from_attempts(
        cls, last: Attempt, *, at_ns: int, attempts: int, calls: tuple[EngineCall, ...], answered_at_ns: int
    ) -> CacheReset:
        """Fold the last attempt into the reset's outcome, with the error worded per SPEC §5.4."""
        error = last.error
        if last.outcome == REFUSED:
            error = f"refused: {last.error or 'refused'} on {attempts} attempts"
        elif last.outcome in (UNSUPPORTED, UNREACHABLE, ERROR):
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
        )


def _success_for(attempt: Attempt) -> bool | None:
    """True only for an acknowledgement, None for a 2xx that did not say, else False (the answer's `success`)."""
    if attempt.outcome == ACKNOWLEDGED:
        return True
    if attempt.outcome == ACCEPTED_UNVERIFIED:
        return None
    return False


def run_kind(requested: str, warmup_requests: int, reset: CacheReset | None = None) -> str:
    """Whether a case was designed as a cold start or a warmed-up steady state (the reference's rule)."""
    if warmup_requests > 0:
        return "steady_state"
    if requested == COLD and (reset is None or reset.succeeded):
        return "cold_start"
    return UNSPECIFIED


def _reason(requested: str, reset: CacheReset | None) -> str:
    """The reference's sentence for why a cache state is what it is."""
    if reset is not None and not reset.succeeded:
        return f"the cache reset failed ({reset.error or reset.status})"
    if reset is not None and reset.acknowledged:
        return "the server acknowledged the cache reset, but no engine adapter can confirm it"
    if reset is not None:
        return (
            f"the cache reset returned HTTP {reset.status} without saying "
            "whether it succeeded, and no engine adapter can confirm it"
        )
    if requested == COLD:
        return "nothing reset the cache, and no engine adapter can read it"
    return (
        "no cache state was requested; earlier traffic, including an earlier "
        "run with the same seed, decides what the cache holds"
    )


def cache_state_record(
    *,
    session_id: str | None,
    case_id: str | None,
    requested: str,
    reset: CacheReset | None,
    warmup_requests: int,
    reset_id: str | None = None,
    engine: EngineInfo | None = None,
    at_ns: int | None = None,
    via: Via = Via.API,
) -> dict[str, Any]:
    """The `infer.cache_state` record (SPEC §5.1): the reference's shape plus `at_ns`, `reset_id`, `engine`, `via`."""
    return {
        "schema_version": 1,
        "event_type": "infer.cache_state",
        "at_ns": at_ns if at_ns is not None else time.time_ns(),
        "session_id": session_id,
        "case_id": case_id,
        "requested": requested,
        "reset": reset.to_record() if reset is not None else None,
        "attempted": reset is not None,
        "acknowledged": reset is not None and reset.acknowledged,
        "verified": UNVERIFIED,
        "reason": _reason(requested, reset),
        "run_kind": run_kind(requested, warmup_requests, reset),
        "reset_id": reset_id,
        "engine": engine.to_json() if engine is not None else None,
        "via": str(via),
    }


def success_field(payload: Any, name: str = "success") -> bool | None:
    """vLLM's `{"success": bool}`: True only for `true`, False for any other value, None without the field."""
    if not isinstance(payload, dict) or name not in payload:
        return None
    return payload[name] is True


def outcome_for_status(status: int) -> tuple[str, str]:
    """The outcome of a non-2xx answer no dialect rule claimed, and what to say: 5xx and other 4xx are errors."""
    if status >= 500:
        return ERROR, f"HTTP {status} from the engine"
    return ERROR, f"HTTP {status}: the engine rejected the reset call"


def _excerpt(body: bytes) -> str:
    """A bounded, printable excerpt of an engine's answer (kept as evidence)."""
    text = body[:BODY_EXCERPT_BYTES].decode("utf-8", errors="replace")
    return text + ("…" if len(body) > BODY_EXCERPT_BYTES else "")


async def _read_bounded(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The whole answer up to `limit` bytes: `read(n)` alone returns only what has arrived so far."""
    parts: list[bytes] = []
    size = 0
    while size < limit:  # bounded: each turn reads at least one byte, or the answer ended
        chunk = await content.read(limit - size)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


async def engine_call(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    timeout_s: float,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
) -> Reply:
    """Make one bounded call to the engine and record it; never raises (except cancellation)."""
    started = time.monotonic()
    recorded = redact_url(url)
    try:
        response = await send_upstream(
            session,
            method,
            url,
            data=body if body is not None else (b"" if method in ("POST", "PUT") else None),
            headers=headers or {},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            allow_redirects=False,
        )
        async with response:
            body = await _read_bounded(response.content, _BODY_READ_LIMIT)
            call = EngineCall(method, recorded, response.status, _excerpt(body), time.monotonic() - started)
            return Reply(call, body)
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        connect = isinstance(exc, aiohttp.ConnectionTimeoutError)
        what = "connect timeout" if connect else f"no answer within {timeout_s:g} s"
        call = EngineCall(method, recorded, None, "", time.monotonic() - started, f"timeout: {what}")
        # A connect timeout is an unreachable engine; a read timeout may be a busy llama.cpp slot.
        return Reply(call, timed_out=not connect)
    except (aiohttp.ClientError, OSError) as exc:
        call = EngineCall(
            method,
            recorded,
            None,
            "",
            time.monotonic() - started,
            f"{type(exc).__name__}: {_redacted_error(exc, url, recorded)}",
        )
        return Reply(call)


def _redacted_error(exc: BaseException, url: str, recorded: str) -> str:
    """An exception's text with the raw URL (and its credentials) replaced by the redacted one."""
    return str(exc).replace(url, recorded)


def bearer(api_key: str | None) -> dict[str, str] | None:
    """The `Authorization` header that carries the engine's own key, None without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


def failed_attempt(reply: Reply, url: str) -> Attempt:
    """The attempt when a call got no HTTP answer at all: the engine is unreachable."""
    return Attempt(UNREACHABLE, error=reply.call.error, url=url, calls=(reply.call,))


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

    @abstractmethod
    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """One reset attempt; never raises."""


def unsupported(url: str, error: str, hint: str, calls: tuple[EngineCall, ...] = ()) -> Attempt:
    """An attempt the engine cannot serve, with how to switch the reset on."""
    return Attempt(
        UNSUPPORTED, error=error, url=url, calls=calls, hint=hint, status=calls[-1].status if calls else None
    )
