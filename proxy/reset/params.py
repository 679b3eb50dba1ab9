"""The parameters of `POST /cache/reset` (docs/reset.md): read from query and body, checked, frozen."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from proxy.config import Settings
from proxy.vocabulary import IsolationMode, Requested, Scope, VerifyMode, Via
from proxy.witnesses.canary import MOST_CANARY_CALLS

__all__ = [
    "INPUT_FIELDS",
    "MAX_RETRY_SECONDS",
    "BadInput",
    "ResetParams",
    "is_valid_id",
    "parse_params",
    "read_params",
    "read_session_id",
    "tag_header",
    "worst_case_seconds",
]

MAX_RETRY_SECONDS = 120.0
# session_id / case_id (docs/reset.md), also the filters of GET /cache/evidence.
_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def is_valid_id(value: object) -> bool:
    """A session or case id: 1-128 characters of [A-Za-z0-9._:-]."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


# What a caller may send; ResetParams' other fields are the sidecar's own (via, retry).
INPUT_FIELDS = (
    "session_id",
    "case_id",
    "requested",
    "warmup_requests",
    "drain",
    "retry_seconds",
    "force",
    "scope",
    "parent_reset_id",
    "verify",
    "bind",
    "isolation",
)
# `scope`: this pod's engine, or every peer's (proxy/cluster/fanout.py).
_BODY_LIMIT = 64 * 1024


class BadInput(Exception):
    """A `/cache/reset` input the sidecar will not take; `param` names the field."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value") -> None:
        """`param` is the field at fault (None for the body as a whole)."""
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code


@dataclass(frozen=True)
class ResetParams:
    """One caller's validated reset request."""

    session_id: str | None = None
    case_id: str | None = None
    requested: Requested = Requested.COLD
    warmup_requests: int = 0
    drain: bool = True
    retry_seconds: float = 10.0
    force: bool = False
    scope: Scope = Scope.POD
    # The cluster reset this pod's reset is part of (set by the pod that fanned it out).
    parent_reset_id: str | None = None
    verify: VerifyMode = VerifyMode.CANARY
    # Only requests carrying the reset's case_token decide its traffic verdict (proxy/witnesses/traffic.py).
    bind: bool = False
    # request: every request of the case is isolated from the prefix cache until its next reset (proxy/isolation/).
    isolation: IsolationMode = IsolationMode.NONE
    # Not caller input: how the reset reached the sidecar, and whether a refusal is retried
    # (an engine's own reset route called with native_resets = "engine" makes one attempt).
    via: Via = Via.API
    retry: bool = True


def worst_case_seconds(settings: Settings, params: ResetParams, *, canary: bool, ranks: int = 1) -> float:
    """The longest one pod's reset can take: the drain, the retry window (SGLang's `?timeout=`
    wait inside an attempt doubles it), the last attempt, and a canary's calls and two more resets
    (once per data-parallel rank). Held requests wait this long at most; a cluster reset waits
    this long for a pod."""
    one_reset = 2 * params.retry_seconds + settings.reset_attempt_timeout
    per_rank = MOST_CANARY_CALLS * settings.reset_attempt_timeout + 2 * one_reset
    canary_s = ranks * per_rank + (ranks - 1) * one_reset if canary else 0.0
    drain = settings.drain_timeout if params.drain else 0.0
    return drain + one_reset + canary_s


def _text_bool(name: str, text: str) -> bool:
    """A query parameter's boolean."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise BadInput(name, f"{name} must be true or false, not {text[:40]!r}")


def _parse_field(name: str, value: Any, from_query: bool) -> Any:
    """One field's value, checked; query values arrive as text, JSON values must have their JSON type."""
    if name in ("session_id", "case_id", "parent_reset_id"):
        if not is_valid_id(value):
            raise BadInput(name, f"{name} must be 1 to 128 characters of A-Z a-z 0-9 . _ : -")
        return value
    if name == "verify":
        if value not in tuple(VerifyMode):
            raise BadInput(name, 'verify must be "none", "canary", "events" or "both"')
        return VerifyMode(value)
    if name == "scope":
        if value not in tuple(Scope):
            raise BadInput(name, 'scope must be "pod" or "cluster"')
        return Scope(value)
    if name == "isolation":
        if value not in tuple(IsolationMode):
            raise BadInput(name, 'isolation must be "none" or "request"')
        return IsolationMode(value)
    if name == "requested":
        if value not in (Requested.COLD, Requested.UNSPECIFIED):
            raise BadInput(name, 'requested must be "cold" or "unspecified"')
        return Requested(value)
    if name in ("drain", "force", "bind"):
        if from_query and isinstance(value, str):
            return _text_bool(name, value)
        if not isinstance(value, bool):
            raise BadInput(name, f"{name} must be a JSON boolean")
        return value
    if name == "warmup_requests":
        if from_query and isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise BadInput(name, "warmup_requests must be a whole number >= 0") from None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadInput(name, "warmup_requests must be a whole number >= 0")
        return value
    # retry_seconds
    if from_query and isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise BadInput(name, "retry_seconds must be a number of seconds from 0 to 120") from None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value <= MAX_RETRY_SECONDS
    ):
        raise BadInput(name, "retry_seconds must be a number of seconds from 0 to 120")
    return float(value)


def parse_params(query: Mapping[str, str], body: Mapping[str, Any], settings: Settings) -> ResetParams:
    """Validated parameters from query text and a JSON object (the body wins); raises BadInput."""
    values: dict[str, Any] = {
        "drain": settings.drain,
        "retry_seconds": float(settings.retry_seconds),
        "verify": settings.verify_default,
    }
    for source, from_query in ((query, True), (body, False)):
        for name, value in source.items():
            if name not in INPUT_FIELDS:
                raise BadInput(
                    name, f"unknown field {name!r}; known fields: {', '.join(INPUT_FIELDS)}", "unknown_field"
                )
            if value is None and not from_query:
                continue  # JSON null: as if not given
            values[name] = _parse_field(name, value, from_query)
    if values.get("scope") == Scope.CLUSTER and values.get("bind"):
        # Each pod's reset has its own case token, and a client cannot tell which pod it reaches.
        raise BadInput("bind", "bind works per pod: reset each pod with scope pod to bind its verdict")
    if values.get("scope") == Scope.CLUSTER and values.get("parent_reset_id") is not None:
        raise BadInput(
            "parent_reset_id", "a cluster reset cannot be part of another one: leave out parent_reset_id"
        )
    if values.get("isolation") == IsolationMode.REQUEST and values.get("case_id") is None:
        # Requests are isolated by the case they carry (X-Case-Id): without one there is nothing to match.
        raise BadInput("isolation", 'isolation "request" isolates a case: give its case_id (and session_id)')
    return ResetParams(**values)


async def _read_bounded(request: web.Request) -> bytes:
    """The body, at most `_BODY_LIMIT` bytes; raises BadInput past that."""
    chunks: list[bytes] = []
    total = 0
    while True:  # bounded: every turn reads at least one byte or ends
        chunk = await request.content.read(_BODY_LIMIT + 1 - total)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > _BODY_LIMIT:
            raise BadInput(None, f"the request body is over {_BODY_LIMIT} bytes", "body_too_large")


def tag_header(request: web.Request, header: str) -> str | None:
    """A session or case id from its header; raises BadInput for one outside the id rule."""
    value = request.headers.get(header)
    if value is None:
        return None
    if not is_valid_id(value):
        raise BadInput(header, f"{header} must be 1 to 128 characters of A-Z a-z 0-9 . _ : -")
    return value


# The headers benchmark tools tag their requests with (aiperf -H, vllm bench --header).
_TAG_HEADERS = (("session_id", "X-Session-Id"), ("case_id", "X-Case-Id"))


async def read_params(request: web.Request, settings: Settings) -> ResetParams:
    """The request's parameters from its body, query string and tag headers, in that precedence; raises BadInput."""
    query: dict[str, str] = {}
    for name, value in request.query.items():
        if name in query:
            raise BadInput(name, f"{name} is given twice in the query string", "duplicate_field")
        query[name] = value
    for name, header in _TAG_HEADERS:
        tag = tag_header(request, header)
        if tag is not None and name not in query:
            query[name] = tag  # the lowest precedence: the query, then the body, win over it
    if request.content_length is not None and request.content_length > _BODY_LIMIT:
        raise BadInput(None, f"the request body is over {_BODY_LIMIT} bytes", "body_too_large")
    raw = await _read_bounded(request) if request.body_exists else b""
    body: Any = {}
    if raw.strip():
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise BadInput(
                None, "the body is not valid JSON; send a JSON object or no body", "invalid_json"
            ) from None
        if not isinstance(body, dict):
            raise BadInput(None, "the body must be a JSON object", "invalid_json")
    return parse_params(query, body, settings)


async def read_session_id(request: web.Request) -> str | None:
    """`session_id` from a JSON body or the query (the body wins), for the case routes; raises BadInput."""
    unknown = sorted(set(request.query) - {"session_id"})
    if unknown:
        raise BadInput(
            unknown[0], f"unknown field {unknown[0]!r}; the only field is session_id", "unknown_field"
        )
    value: Any = request.query.get("session_id")
    raw = await _read_bounded(request) if request.body_exists else b""
    if raw.strip():
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise BadInput(
                None, "the body is not valid JSON; send a JSON object or no body", "invalid_json"
            ) from None
        if not isinstance(body, dict) or set(body) - {"session_id"}:
            raise BadInput(None, 'the body must be a JSON object with at most "session_id"', "invalid_json")
        value = body.get("session_id", value)
    if value is not None and not is_valid_id(value):
        raise BadInput("session_id", "session_id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -")
    return value if isinstance(value, str) else None
