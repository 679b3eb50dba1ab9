"""Builds the aiohttp application: routes, middlewares, and the shared resources' lifetimes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

from proxy.admission import Admission
from proxy.auth import admin_middleware
from proxy.cache_views import handle_evidence, handle_state
from proxy.cluster import setup_cluster
from proxy.config import Settings
from proxy.engine_state import EngineState
from proxy.evidence import EvidenceWriter
from proxy.forward import forward
from proxy.health import UpstreamHealth, healthy, ready
from proxy.keys import ADMISSION, CLIENT, ENGINE, EVIDENCE, HEALTH, SETTINGS, WITNESS
from proxy.metrics import setup_metrics
from proxy.reset import handle_reset, setup_reset
from proxy.witness import Witness

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
    await app[ENGINE].detect(session)
    watcher = asyncio.create_task(app[HEALTH].watch(session))
    yield
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    await session.close()


async def _evidence_log(app: web.Application) -> AsyncIterator[None]:
    """Own the evidence writer: started first, closed (flushed, fsync'd) after the last stream."""
    writer = app[EVIDENCE]
    await writer.start()
    yield
    await writer.close()


def build_app(settings: Settings) -> web.Application:
    """The sidecar application for `settings`.

    TCP_NODELAY needs no code here: aiohttp sets it on every connection, both sides
    (`aiohttp/base_protocol.py`).
    """
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[admin_middleware(settings)])
    app[SETTINGS] = settings
    app[ADMISSION] = Admission()
    engine = EngineState(settings)
    app[ENGINE] = engine

    async def redetect(recovered: bool) -> None:
        # Back after being down: it may be another engine now. First contact: detect if
        # start-up detection could not reach it.
        if recovered:
            await engine.upstream_came_back(app[CLIENT])
        else:
            await engine.ensure_detected(app[CLIENT])

    app[HEALTH] = UpstreamHealth(
        settings.upstream_base, settings.health_interval, path=lambda: engine.health_path, on_up=redetect
    )
    app[WITNESS] = Witness()
    app[EVIDENCE] = EvidenceWriter(
        Path(settings.evidence),
        max_bytes=settings.evidence_max_bytes,
        keep=settings.evidence_keep,
        stdout=settings.evidence_stdout,
    )
    setup_reset(app)
    setup_metrics(app)
    # Order matters: the evidence writer outlives the upstream pool, so records of the
    # last streams finishing at shutdown still get written.
    app.cleanup_ctx.append(_evidence_log)
    app.cleanup_ctx.append(_upstream_pool)
    setup_cluster(app)
    app.router.add_get("/-/healthy", healthy)
    app.router.add_get("/-/ready", ready)
    app.router.add_post("/cache/reset", handle_reset)
    app.router.add_get("/cache/state", handle_state)
    app.router.add_get("/cache/evidence", handle_evidence)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app
