"""The one keep-alive pool toward the engine and its lifetime.

uvicorn (vLLM, SGLang) closes a connection after 5 s idle: the pool drops connections idle
past `upstream_keepalive_timeout` (default 4 s, below the engine's); proxy/resend.py covers
the race that remains.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from proxy.config import SETTINGS, Settings
from proxy.resend import reuse_trace

__all__ = ["UPSTREAM_POOL", "make_client_session", "setup_upstream_pool"]

UPSTREAM_POOL = web.AppKey("upstream_pool", aiohttp.ClientSession)


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


def setup_upstream_pool(app: web.Application) -> None:
    """Open the pool at start, close it after everything that uses it has stopped.

    It lives in cleanup_ctx (not on_shutdown) so streams still draining at shutdown keep
    their upstream connection (SPEC §11).
    """

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        session = make_client_session(app[SETTINGS])
        app[UPSTREAM_POOL] = session
        yield
        await session.close()

    app.cleanup_ctx.append(lifetime)
