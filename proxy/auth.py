"""Admin auth: the sidecar's own `/cache/*` routes and the engine's control routes (SPEC §3, issue 14).

Admin rules: with a token configured, `Authorization: Bearer <token>` (else 401); with
none, loopback clients only (else 403), unless `admin_open`. Ordinary forwarded traffic
needs no admin auth, and the admin token never travels on to the engine.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware
from multidict import CIMultiDict

from proxy.config import SETTINGS, EngineRoutes, NativeResetAuth, Settings
from proxy.engine_routes import RouteClass, RouteDecision, RoutePolicy
from proxy.engine_state import ENGINE
from proxy.errors import error_response
from proxy.forward import forward
from proxy.logs import log_event
from proxy.native_reset import handle_native_reset, handle_slot_erase
from proxy.pool import UPSTREAM_POOL

__all__ = ["ADMIN_PREFIX", "admin_middleware", "engine_authorization", "is_loopback", "setup_auth"]

log = logging.getLogger("cachewitness.auth")

ADMIN_PREFIX = "/cache/"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

NO_TOKEN_MESSAGE = (
    "admin routes (/cache/* and the engine's control routes) answer only loopback clients while no "
    "admin token is set: set one with --admin-token-file FILE (or CACHEWITNESS_ADMIN_TOKEN) and send "
    "'Authorization: Bearer <token>', or start the sidecar with --admin-open to let any client in"
)


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and their IPv4-mapped forms; False for anything unparseable."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _peer_host(request: web.Request) -> str | None:
    """The TCP peer's address (not a forwarded header: those are the client's to forge)."""
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    return None


def _token_of(value: str) -> str | None:
    """The token of one `Authorization: Bearer <token>` value, None for anything else."""
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _bearer(request: web.Request) -> str | None:
    """The token of the request's `Authorization: Bearer <token>` header, None without one."""
    return _token_of(request.headers.get("Authorization", ""))


def _same(given: str, expected: str) -> bool:
    """Constant-time comparison of two secrets."""
    # surrogateescape: a header that was not UTF-8 is a wrong token (401), not a crash.
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8"))


def admin_denial(
    request: web.Request, settings: Settings, *, engine_key: str | None = None
) -> web.Response | None:
    """None when the caller may use an admin route, else the 401/403 answer.

    `engine_key`, when given, is accepted as well (native_reset_auth = upstream_api_key).
    """
    given = _bearer(request)
    if engine_key is not None and given is not None and _same(given, engine_key):
        return None
    if settings.admin_token is not None:
        if given is not None and _same(given, settings.admin_token):
            return None
        message = (
            "missing admin token: send 'Authorization: Bearer <token>' with the sidecar's admin token"
            if given is None
            else "wrong admin token"
        )
        return error_response(
            401,
            message,
            type_="authentication_error",
            code="missing_admin_token" if given is None else "invalid_admin_token",
            headers={"WWW-Authenticate": 'Bearer realm="cachewitness"'},
        )
    if settings.admin_open or is_loopback(_peer_host(request)):
        return None
    return error_response(403, NO_TOKEN_MESSAGE, type_="permission_error", code="admin_loopback_only")


def engine_authorization(request: web.Request, settings: Settings, *, control: bool) -> list[str]:
    """The `Authorization` values the engine gets: never the admin token; on control calls the engine's key."""
    engine_key = settings.engine_key
    if control and engine_key is not None:
        return [f"Bearer {engine_key}"]
    admin = settings.admin_token
    return [
        value
        for value in request.headers.getall("Authorization", ())
        if admin is None or (token := _token_of(value)) is None or not _same(token, admin)
    ]


def _toward_engine(request: web.Request, settings: Settings, *, control: bool) -> web.Request:
    """The request as the engine may see it: a clone only when its `Authorization` must change."""
    values = engine_authorization(request, settings, control=control)
    if values == request.headers.getall("Authorization", []):
        return request
    headers = CIMultiDict(request.headers)
    headers.popall("Authorization", None)
    for value in values:
        headers.add("Authorization", value)
    return request.clone(headers=headers)


async def _classify(request: web.Request, policy: RoutePolicy) -> RouteDecision:
    """The route class for the engine fronted now; detection runs first if a control path meets an unknown kind."""
    engine = request.app[ENGINE]
    decision = policy.classify(request.method, request.rel_url.raw_path, request.query, engine.dialect)
    if (
        decision.route is not RouteClass.FORWARDED
        and not policy.knows(engine.dialect)
        and not engine.detected
    ):
        await engine.ensure_detected(request.app[UPSTREAM_POOL])
        decision = policy.classify(request.method, request.rel_url.raw_path, request.query, engine.dialect)
    return decision


def admin_middleware(settings: Settings) -> Middleware:
    """The middleware that applies the route policy to every request."""
    policy = RoutePolicy(settings)
    guarded = settings.engine_routes == EngineRoutes.ADMIN
    reset_key = (
        settings.engine_key if settings.native_reset_auth == NativeResetAuth.UPSTREAM_API_KEY else None
    )

    @web.middleware
    async def route_policy(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Sidecar routes under /cache/ and engine control routes need admin auth; the rest passes."""
        match = request.match_info
        if match.handler is not forward:
            # The sidecar's own route, exactly as registered (method and path): under
            # /cache/ it is an admin route. Any other /cache/* request is forwarded.
            resource = match.route.resource
            if resource is not None and resource.canonical.startswith(ADMIN_PREFIX):
                denial = admin_denial(request, settings)
                if denial is not None:
                    return denial
            return await handler(request)
        decision = await _classify(request, policy)
        if decision.route is RouteClass.FORWARDED:
            return await handler(_toward_engine(request, settings, control=False))
        if guarded:
            key = reset_key if decision.route is RouteClass.NATIVE_RESET else None
            denial = admin_denial(request, settings, engine_key=key)
            if denial is not None:
                log_event(
                    log,
                    logging.INFO,
                    "engine control route refused",
                    event="control_route_refused",
                    method=request.method,
                    path=decision.path[:200],
                    status=denial.status,
                    peer=_peer_host(request),
                )
                return denial
        if decision.route is RouteClass.NATIVE_RESET and decision.native is not None:
            return await handle_native_reset(request, decision.native)
        if decision.route is RouteClass.SLOT_ERASE:
            return await handle_slot_erase(
                request, decision.path, engine_authorization(request, settings, control=True)
            )
        return await handler(_toward_engine(request, settings, control=True))

    return route_policy


def setup_auth(app: web.Application) -> None:
    """Apply the route policy before every handler: admin auth, the engine's credentials, interception."""
    app.middlewares.append(admin_middleware(app[SETTINGS]))
