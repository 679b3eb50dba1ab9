"""Admin auth on the sidecar's own `/cache/*` routes; forwarded traffic is never touched (SPEC §3)."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.config import SETTINGS, Settings
from proxy.errors import error_response

__all__ = ["ADMIN_PREFIX", "admin_middleware", "is_loopback", "setup_auth"]

ADMIN_PREFIX = "/cache/"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

NO_TOKEN_MESSAGE = (
    "admin routes (/cache/*) answer only loopback clients while no admin token is set: set one with "
    "--admin-token-file FILE (or CACHEWITNESS_ADMIN_TOKEN) and send 'Authorization: Bearer <token>', "
    "or start the sidecar with --admin-open to let any client in"
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


def _bearer(request: web.Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, None without one."""
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def admin_middleware(settings: Settings) -> Middleware:
    """A middleware guarding paths under `/cache/`: bearer token if one is set, else loopback only (unless admin_open)."""
    expected = settings.admin_token.encode("utf-8") if settings.admin_token else None
    admin_open = settings.admin_open

    @web.middleware
    @web.middleware
    async def admin_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Let admin calls through only when they may be made; everything else passes untouched."""
        if not request.path.startswith(ADMIN_PREFIX):
            return await handler(request)
        if expected is not None:
            given = _bearer(request)
            # surrogateescape: a header that was not UTF-8 is a wrong token (401), not a crash.
            if given is None or not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected):
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
            return await handler(request)
        if admin_open or is_loopback(_peer_host(request)):
            return await handler(request)
        return error_response(403, NO_TOKEN_MESSAGE, type_="permission_error", code="admin_loopback_only")

    return admin_auth


def setup_auth(app: web.Application) -> None:
    """Guard the sidecar's own admin routes (the middleware runs before every handler)."""
    app.middlewares.append(admin_middleware(app[SETTINGS]))
