"""Who may: admin auth for the sidecar's own `/cache/*` routes and the engine's control routes (docs/routes.md).

Admin rules: with a token configured, `Authorization: Bearer <token>` (else 401); with
none, clients from `trusted_peers` only (default 127.0.0.1 and ::1, not all of 127/8: a
mesh proxy connects from 127.0.0.6; else 403), unless `admin_open`. Ordinary forwarded
traffic needs no admin auth, and the admin token never travels on to the engine: every
header whose value holds it is dropped, whatever its name or scheme. The route policy that
applies these rules to every request is proxy/admin/middleware.py.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hmac
import ipaddress
from collections.abc import Iterable
from urllib.parse import unquote_plus

from aiohttp import web

from proxy.admin.policy import DECODE_PASSES
from proxy.config import Settings
from proxy.errors import error_response
from proxy.refusals import RefusalReason

__all__ = [
    "ADMIN_PREFIX",
    "admin_denial",
    "carries_token",
    "engine_authorization",
    "holds_token",
    "is_trusted",
    "peer_host",
    "query_without_token",
    "unescaped",
    "without_token",
]

ADMIN_PREFIX = "/cache/"

NO_TOKEN_MESSAGE = (
    "admin routes (/cache/* and the engine's control routes) answer only clients from trusted_peers "
    "(default 127.0.0.1 and ::1) while no admin token is set: set one with --admin-token-file FILE "
    "(or CACHEWITNESS_ADMIN_TOKEN) and send 'Authorization: Bearer <token>', add the client's "
    "address to --trusted-peers, or start the sidecar with --admin-open to let any client in"
)
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@functools.lru_cache(maxsize=8)
def _networks(peers: tuple[str, ...]) -> tuple[Network, ...]:
    """`trusted_peers` parsed once (config has checked every entry)."""
    return tuple(ipaddress.ip_network(peer, strict=False) for peer in peers)


def is_trusted(host: str | None, peers: tuple[str, ...]) -> bool:
    """Whether the peer address `host` (IPv4-mapped forms as IPv4) is in `peers`; False when unparseable."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in network for network in _networks(peers))


def peer_host(request: web.Request) -> str | None:
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


def unescaped(text: str) -> str:
    """`text` percent-decoded twice, `+` as a space (what a cookie or query parser may make of it)."""
    for _ in range(DECODE_PASSES):
        text = unquote_plus(text, errors="replace")
    return text


def carries_token(value: str, token: str) -> bool:
    """Whether a header value holds `token` anywhere, percent-encoded, or as a `Basic` credential's user or password.

    Any spelling counts (`Bearer` and a tab, `Bearer <t>, x`, `Basic <t>`, a cookie, `%61...`):
    an engine or its logs may parse what the sidecar's own bearer check does not.
    """
    if token in value or ("%" in value and token in unescaped(value)):
        return True
    if value[:5].lower() != "basic":
        return False
    parts = value.split(None, 1)
    if len(parts) != 2 or parts[0].lower() != "basic":
        return False
    return token in _basic_credential(parts[1])


def _basic_credential(encoded: str) -> str:
    """A Basic credential decoded as the most lenient decoder would: whitespace and characters
    outside the alphabet skipped, padding optional, either alphabet (Python's b64decode without
    `validate` reads `YWRt aW4=` as `admin`)."""
    packed = "".join(encoded.split())
    packed += "=" * (-len(packed) % 4)
    decoded = []
    for altchars in (None, b"-_"):
        try:
            decoded.append(base64.b64decode(packed, altchars=altchars).decode("utf-8", "replace"))
        except (binascii.Error, ValueError):
            continue
    return "\n".join(decoded)


def admin_denial(
    request: web.Request, settings: Settings, *, engine_key: str | None = None
) -> tuple[RefusalReason, web.Response] | None:
    """None when the caller may use an admin route, else why not and the 401/403 answer.

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
        reason = RefusalReason.MISSING_ADMIN_TOKEN if given is None else RefusalReason.INVALID_ADMIN_TOKEN
        return reason, error_response(
            401,
            message,
            type_="authentication_error",
            code=str(reason),
            headers={"WWW-Authenticate": 'Bearer realm="cachewitness"'},
        )
    if settings.admin_open or is_trusted(peer_host(request), settings.trusted_peers):
        return None
    reason = RefusalReason.ADMIN_LOOPBACK_ONLY
    return reason, error_response(403, NO_TOKEN_MESSAGE, type_="permission_error", code=str(reason))


def engine_authorization(request: web.Request, settings: Settings, *, control: bool) -> list[str]:
    """The `Authorization` values the engine gets: never the admin token; on control calls the engine's key."""
    engine_key = settings.engine_key
    if control and engine_key is not None:
        return [f"Bearer {engine_key}"]
    admin = settings.admin_token
    return [
        value
        for value in request.headers.getall("Authorization", ())
        if admin is None or not carries_token(value, admin)
    ]


def holds_token(name: str, value: str, token: str) -> bool:
    """Whether one header holds the admin token, in its value or (oddly) its name."""
    if token in value or token in name:
        return True
    if ("%" in value or "%" in name) and (token in unescaped(value) or token in unescaped(name)):
        return True
    # Runs on every forwarded request's every header: the Basic decoding only where it can apply.
    return value[:1] in ("b", "B") and carries_token(value, token)


def query_without_token(query: str, token: str) -> str | None:
    """`query` (raw) without the parameters holding `token`, as sent or escaped; None when none does."""
    params = query.split("&")
    kept = [param for param in params if token not in param and token not in unescaped(param)]
    return None if len(kept) == len(params) else "&".join(kept)


def without_token(headers: Iterable[tuple[str, str]], token: str | None) -> list[tuple[str, str]]:
    """The headers that do not hold the admin token."""
    return [(name, value) for name, value in headers if token is None or not holds_token(name, value, token)]
