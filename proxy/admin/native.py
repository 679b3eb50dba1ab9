"""The engines' own reset routes, called through the sidecar: recorded, and answered in the engine's shape.

vLLM `POST /reset_prefix_cache`, SGLang `GET|POST /flush_cache` and mindnano
`POST /v1/cache/clear` go through the reset service (proxy/reset/service.py) like `/cache/reset`,
with `via: "native"`: `native_resets = "engine"` makes one attempt without drain (the
engine's own semantics), `"uniform"` the whole uniform reset. In engine mode the caller gets
the engine's status and body. In uniform mode the status says the uniform reset's answer, so
that tools which read only the status (aiperf, SGLang's bench_serving, `vllm bench sweep`)
fail loudly: 2xx only for a reset the engine accepted and no witness contradicted, 409 refused
after the retries, 501 unsupported, 502 contradicted or the engine unreachable; the body stays
in the engine's shape (docs/routes.md). llama.cpp `POST /slots/{id}?action=erase` is passed on
as it is and recorded.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from proxy.config import SETTINGS, NativeResets, Settings
from proxy.engine_state import ENGINE
from proxy.engines.base import CacheReset
from proxy.engines.call import bearer, engine_call
from proxy.engines.llamacpp import erase_attempt
from proxy.engines.routes import NativeReset
from proxy.errors import error_response
from proxy.evidence.records import cache_state_record
from proxy.recorder import RECORDER
from proxy.reset.params import MAX_RETRY_SECONDS, BadInput, ResetParams, tag_header
from proxy.reset.service import RESETS
from proxy.upstream.pools import UPSTREAM_POOL
from proxy.vocabulary import Requested, ResetAnswer, VerifyMode, Via

__all__ = ["handle_native_reset", "handle_slot_erase", "native_params"]

_TRUE = frozenset({"1", "true", "yes", "on", "t", "y"})
_FALSE = frozenset({"0", "false", "no", "off", "f", "n"})


def _single(request: web.Request, name: str) -> str | None:
    """A query parameter given at most once."""
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise BadInput(name, f"{name} is given twice in the query string", "duplicate_field")
    return values[0] if values else None


def _flag(name: str, text: str) -> bool:
    """A boolean query parameter, spelled as FastAPI (vLLM) accepts it."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise BadInput(name, f"{name} must be true or false, not {text[:40]!r}")


def _seconds(name: str, text: str) -> float:
    """A wait in seconds, 0 to 120."""
    try:
        value = float(text.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 <= value <= MAX_RETRY_SECONDS:
        raise BadInput(name, f"{name} must be a number of seconds from 0 to {MAX_RETRY_SECONDS:g}")
    return value


def native_params(request: web.Request, native: NativeReset, settings: Settings) -> ResetParams:
    """The reset a native call asks for: its own parameters mapped, the mode's drain and retries."""
    engine_mode = settings.native_resets == NativeResets.ENGINE
    force = False
    if native.force_param and (text := _single(request, native.force_param)) is not None:
        force = _flag(native.force_param, text)
    wait: float | None = None
    if native.wait_param and (text := _single(request, native.wait_param)) is not None:
        wait = _seconds(native.wait_param, text)
    default_wait = 0.0 if engine_mode else float(settings.retry_seconds)
    return ResetParams(
        session_id=tag_header(request, "X-Session-Id"),
        case_id=tag_header(request, "X-Case-Id"),
        drain=settings.drain and not engine_mode,
        retry_seconds=default_wait if wait is None else wait,
        force=force,
        via=Via.NATIVE,
        retry=not engine_mode,
        # The engine's own semantics have no canary; the uniform reset verifies as configured.
        verify=VerifyMode.NONE if engine_mode else settings.verify_default,
    )


# Uniform mode: the status of each failed answer (the accepted ones keep the engine's 2xx).
_UNIFORM_STATUS: dict[str, int] = {
    ResetAnswer.REFUSED: 409,
    ResetAnswer.UNSUPPORTED: 501,
    ResetAnswer.CONTRADICTED: 502,
    ResetAnswer.UNREACHABLE: 502,
    ResetAnswer.ERROR: 502,
}


def _uniform_answer(native: NativeReset, word: str, status: int, body: bytes) -> tuple[int, bytes]:
    """The status that says the uniform reset's answer, and a body in the engine's shape."""
    if word in (ResetAnswer.ACKNOWLEDGED, ResetAnswer.ACCEPTED_UNVERIFIED) and 200 <= status < 300:
        return status, body
    failed = _UNIFORM_STATUS.get(word, 502)
    if 200 <= status < 300:
        # The engine's last words were a yes (vLLM's refusal too is a 200): its own "not reset".
        return failed, native.refusal_body
    return failed, body


def _engine_shaped(native: NativeReset, answer: dict[str, Any], mode: NativeResets) -> web.Response:
    """The caller's answer in its engine's shape, with the X-Cachewitness-* headers saying ours."""
    calls = answer.get("calls") or []
    last: dict[str, Any] = calls[-1] if calls and isinstance(calls[-1], dict) else {}
    status = last.get("status")
    if not isinstance(status, int):
        message = answer.get("detail") or "the engine did not answer the reset"
        return error_response(502, str(message), type_="upstream_error", code="upstream_unreachable")
    body = str(last.get("body_excerpt", "")).encode("utf-8")
    if mode == NativeResets.UNIFORM:
        status, body = _uniform_answer(native, str(answer.get("answer", "")), status, body)
    response = web.Response(status=status, body=body, headers={"Content-Type": native.content_type})
    response.headers["X-Cachewitness-Reset-Id"] = str(answer.get("reset_id", ""))
    response.headers["X-Cachewitness-Answer"] = str(answer.get("answer", ""))
    response.headers["X-Cachewitness-Verified"] = str(answer.get("verified", ""))
    return response


async def handle_native_reset(request: web.Request, native: NativeReset) -> web.Response:
    """An engine's own reset route: the reset service runs it; the answer has the engine's shape."""
    settings = request.app[SETTINGS]
    try:
        params = native_params(request, native, settings)
    except BadInput as bad:
        return error_response(400, bad.message, type_="invalid_request_error", code=bad.code, param=bad.param)
    status, answer = await request.app[RESETS].reset(params)
    if "reset_id" not in answer:  # the sidecar failed (500): its own error, as /cache/reset gives it
        return web.Response(status=status, body=orjson.dumps(answer), content_type="application/json")
    return _engine_shaped(native, answer, settings.native_resets)


async def handle_slot_erase(request: web.Request, path: str, authorization: list[str]) -> web.Response:
    """llama.cpp `POST /slots/{id}?action=erase`: passed on once, answered as the engine answered, recorded."""
    app = request.app
    settings = app[SETTINGS]
    try:
        session_id, case_id = tag_header(request, "X-Session-Id"), tag_header(request, "X-Case-Id")
    except BadInput as bad:
        return error_response(400, bad.message, type_="invalid_request_error", code=bad.code, param=bad.param)
    headers = {"Authorization": authorization[0]} if authorization else bearer(None)
    at_ns = time.time_ns()
    # A busy slot's erase waits for its generation to end: as long as any forwarded answer may.
    reply = await engine_call(
        app[UPSTREAM_POOL],
        "POST",
        settings.upstream_base + request.rel_url.raw_path_qs,
        timeout_s=settings.read_timeout or 600.0,
        headers=headers,
    )
    attempt = erase_attempt(reply)
    reset = CacheReset.from_attempts(
        attempt, at_ns=at_ns, attempts=1, calls=attempt.calls, answered_at_ns=time.time_ns()
    )
    record = cache_state_record(
        session_id=session_id,
        case_id=case_id,
        requested=Requested.UNSPECIFIED,
        reset=reset,
        warmup_requests=0,
        reset_id=uuid.uuid4().hex,
        engine=app[ENGINE].info,
        via=Via.NATIVE,
    )
    # One slot of several is not the whole cache: the record says which call it was.
    record["route"] = f"POST {path}?action=erase"
    app[RECORDER].slot_erased(record)
    if reply.status is None:
        message = reply.call.error or "the engine did not answer"
        return error_response(
            502, f"slot erase: {message}", type_="upstream_error", code="upstream_unreachable"
        )
    return web.Response(status=reply.status, body=reply.body, headers={"Content-Type": "application/json"})
