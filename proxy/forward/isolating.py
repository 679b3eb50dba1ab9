"""An isolated request made so before it reaches the engine, or refused: never sent warm.

The decision (header, case, config), the per-engine rule and the byte-level rewrite are
proxy/isolation/'s; this module applies them to one exchange.
"""

from __future__ import annotations

from aiohttp import web

from proxy.errors import error_response
from proxy.forward.exchange import ClientRequest, Exchange
from proxy.forward.services import Services
from proxy.isolation import (
    ISOLATION_HEADER,
    BadIsolationHeader,
    Unrewritable,
    header_asks,
    isolated_request,
    rule_for,
)
from proxy.observe import PreparedRequest, is_observed
from proxy.vocabulary import EngineKind, IsolationResult

__all__ = ["isolate"]

Ids = tuple[str | None, str | None]  # the request's session and case, as the evidence stores them

_UNSUPPORTED_HINT = (
    "send this request without isolation (no X-Cachewitness-Isolation header, a case reset with "
    'isolation "none", config isolation = "none") and reset the cache before the case instead'
)


def isolate(
    services: Services, request: ClientRequest, exchange: Exchange, prepared: PreparedRequest | None
) -> PreparedRequest | web.Response | None:
    """The request to send (isolated if it must be), or the sidecar's own answer when it cannot be isolated."""
    isolation, headers = services.recorder.isolation, request.headers
    if request.method != "POST" or (not isolation.active and ISOLATION_HEADER not in headers):
        return prepared  # the common case: nothing asks for isolation
    ids = exchange.stored_ids(headers)
    try:
        asked = header_asks(headers)
    except BadIsolationHeader as bad:
        return _refused(services, ids, exchange, 400, str(bad), "invalid_isolation")
    if not is_observed(request.method, request.path):
        if not asked:
            return prepared  # config and case isolation cover the inference routes only
        return _unsupported(
            services, ids, exchange, f"{request.path} is not an inference route the sidecar observes"
        )
    if not isolation.wanted(asked, *ids):
        return prepared
    settings = services.settings
    if not settings.observe:
        return _unsupported(
            services, ids, exchange, "the sidecar runs with observe = false: nothing could prove it cold"
        )
    if prepared is None:
        return _refused(
            services,
            ids,
            exchange,
            413,
            f"an isolated request's body must fit max_buffered_bytes ({settings.max_buffered_bytes} bytes) "
            "to be rewritten; this one is streamed unobserved",
            "isolation_body_too_large",
        )
    info = services.engine.info
    rule = rule_for(info, request.path)
    if rule is None:
        return _unsupported(services, ids, exchange, _why_unsupported(info.kind, info.version, request.path))
    try:
        isolated = isolated_request(prepared, rule)
    except Unrewritable as bad:
        return _refused(services, ids, exchange, 400, str(bad), "isolation_invalid_body")
    exchange.isolation_field = rule.field
    return isolated


def _why_unsupported(kind: str, version: str | None, path: str) -> str:
    """What the engine lacks, in words."""
    if kind in (EngineKind.UNKNOWN, EngineKind.NONE, EngineKind.GENERIC):
        return f"the engine ({kind}) has no per-request cache isolation the sidecar knows"
    return f"{kind} {version or '(version unknown)'} has no per-request cache isolation on {path}"


def _unsupported(services: Services, ids: Ids, exchange: Exchange, why: str) -> web.Response:
    """501 isolation_unsupported, with what to do instead."""
    return _refused(
        services,
        ids,
        exchange,
        501,
        f"this request cannot be isolated: {why}",
        "isolation_unsupported",
        hint=_UNSUPPORTED_HINT,
    )


def _refused(
    services: Services,
    ids: Ids,
    exchange: Exchange,
    status: int,
    message: str,
    code: str,
    *,
    hint: str | None = None,
) -> web.Response:
    """The sidecar's answer to an isolated request that must not run, counted in its case's tally."""
    services.recorder.isolation.counted(*ids, IsolationResult.REFUSED)
    exchange.isolation_refused = True
    type_ = "server_error" if status == 501 else "invalid_request_error"
    return error_response(status, message, type_=type_, code=code, hint=hint)
