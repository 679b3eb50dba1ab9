"""The one keep-alive pool toward the engine and its lifetime.

uvicorn (vLLM, SGLang) closes a connection after 5 s idle: the pool drops connections idle
past `upstream_keepalive_timeout` (default 4 s, below the engine's); proxy/upstream/resend.py covers
the race that remains.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from proxy.config import SETTINGS, Settings
from proxy.upstream import UpstreamLeg
from proxy.upstream.resend import reuse_trace

__all__ = ["UPSTREAM_LEG", "UPSTREAM_POOL", "make_client_session", "make_leg", "setup_upstream_pool"]

# The sidecar's own calls to the engine (detection, health, resets, the canary, /metrics).
UPSTREAM_POOL = web.AppKey("upstream_pool", aiohttp.ClientSession)
# Forwarded traffic: the hot path, on its own protocol-level pool (proxy/upstream).
UPSTREAM_LEG = web.AppKey("upstream_leg", UpstreamLeg)


def make_client_session(settings: Settings) -> aiohttp.ClientSession:
    """The one keep-alive pool toward the upstream, transparent by construction."""
    connector = aiohttp.TCPConnector(
        # aiohttp's default limit of 100 would queue the 101st stream inside the sidecar.
        limit=settings.upstream_connection_limit,
        limit_per_host=0,
        ttl_dns_cache=300,
        enable_cleanup_closed=False,
        force_close=False,
        # Below the engine's own idle timeout, so the pool drops a connection before the engine does.
        keepalive_timeout=settings.upstream_keepalive_timeout,
    )
    timeout = aiohttp.ClientTimeout(
        total=None,  # streams may last as long as the engine generates
        sock_connect=settings.connect_timeout or None,
        sock_read=settings.read_timeout or None,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,  # content-encoding passes through untouched
        trust_env=False,  # no environment proxy between the sidecar and its engine
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
        raise_for_status=False,
        trace_configs=[reuse_trace()],
    )


def make_leg(settings: Settings) -> UpstreamLeg:
    """The forwarding pool toward the upstream, with the same timeouts and limits as the session."""
    return UpstreamLeg(
        settings.upstream_base,
        connect_timeout=settings.connect_timeout,
        read_timeout=settings.read_timeout,
        keepalive=settings.upstream_keepalive_timeout,
        limit=settings.upstream_connection_limit,
        max_head_bytes=settings.max_upstream_head_bytes,
    )


def setup_upstream_pool(app: web.Application) -> None:
    """Open the pools at start, close them after everything that uses them has stopped.

    It lives in cleanup_ctx (not on_shutdown) so streams still draining at shutdown keep
    their upstream connection (docs/architecture.md).
    """

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        session = make_client_session(app[SETTINGS])
        app[UPSTREAM_POOL] = session
        leg = make_leg(app[SETTINGS])
        app[UPSTREAM_LEG] = leg
        yield
        leg.close()
        await session.close()

    app.cleanup_ctx.append(lifetime)
