"""Builds the aiohttp application: routes, middlewares, and the shared resources' lifetimes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from proxy.admission import Admission
from proxy.config import Settings
from proxy.forward import forward
from proxy.health import UpstreamHealth, healthy, ready
from proxy.keys import ADMISSION, CLIENT, HEALTH, SETTINGS

__all__ = ["build_app", "make_client_session"]


def make_client_session(settings: Settings) -> aiohttp.ClientSession:
    """The one keep-alive pool toward the upstream, transparent by construction."""
    connector = aiohttp.TCPConnector(
        # aiohttp's default limit of 100 would queue the 101st stream inside the sidecar.
        limit=settings.upstream_connection_limit,
        limit_per_host=0,
        ttl_dns_cache=300,
        enable_cleanup_closed=False,
        force_close=False,
        keepalive_timeout=60,
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
    )


async def _upstream_pool(app: web.Application) -> AsyncIterator[None]:
    """Own the client session and the health watcher for the app's whole life.

    They live in cleanup_ctx (not on_shutdown) so streams still draining at shutdown
    keep their upstream connection (SPEC §11).
    """
    session = make_client_session(app[SETTINGS])
    app[CLIENT] = session
    watcher = asyncio.create_task(app[HEALTH].watch(session))
    yield
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    await session.close()


def build_app(settings: Settings) -> web.Application:
    """The sidecar application for `settings`.

    TCP_NODELAY needs no code here: aiohttp sets it on every connection, both sides
    (`aiohttp/base_protocol.py`).
    """
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[])
    app[SETTINGS] = settings
    app[ADMISSION] = Admission()
    app[HEALTH] = UpstreamHealth(
        settings.upstream_base,
        settings.health_interval,
        path=lambda: settings.health_path or "/health",
    )
    app.cleanup_ctx.append(_upstream_pool)
    app.router.add_get("/-/healthy", healthy)
    app.router.add_get("/-/ready", ready)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app
