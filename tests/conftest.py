"""Shared fixtures: serve real aiohttp apps on loopback ports for each test."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.app import build_app
from proxy.config import SETTINGS, Settings
from proxy.serve import make_runner, make_site


@asynccontextmanager
async def serve_app(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve `app` on `host` and `port` (0: a free one).

    A sidecar app (one `build_app` made) is served by the very runner `cachewitness serve`
    uses, so transport behaviour under test (disconnects, shutdown) is production's; any
    other app (a test upstream, a simulator) by a plain runner that, like the engines'
    servers, notices a client that leaves (handler cancellation on).
    """
    site: web.BaseSite
    if SETTINGS in app:
        runner = make_runner(app, app[SETTINGS])
        await runner.setup()
        site = make_site(runner, host, port)
    else:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def free_port() -> int:
    """A loopback port nothing listens on (until someone binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def closed_port_url() -> str:
    """A loopback URL nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain client session."""
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def upstream_app() -> web.Application:
    """The controllable test upstream (tests/upstream.py)."""
    from tests.upstream import build_upstream

    return build_upstream()


@pytest.fixture
async def upstream(upstream_app: web.Application) -> AsyncIterator[str]:
    """The test upstream served on a loopback port."""
    async with serve_app(upstream_app) as url:
        yield url


def make_settings(upstream: str, tmp_path: Path, **overrides: Any) -> Settings:
    """Settings for a sidecar under test: loopback, evidence in tmp_path, fast health probes."""
    base = Settings(
        upstream=upstream,
        listen="127.0.0.1:0",
        evidence=str(tmp_path / "evidence" / "cachewitness.jsonl"),
        health_interval=0.2,
        grace_period=5.0,  # bounds a test's teardown when a stream is still open
    )
    return dataclasses.replace(base, **overrides)


SidecarFactory = Callable[..., Awaitable[str]]


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[SidecarFactory]:
    """Start sidecars in front of a given upstream: `url = await sidecar(upstream, **settings)`."""
    async with _Stack() as stack:

        async def start(upstream: str, **overrides: Any) -> str:
            app = build_app(make_settings(upstream, tmp_path, **overrides))
            stack.apps.append(app)
            return await stack.enter(serve_app(app))

        yield start


class _Stack:
    """A tiny AsyncExitStack that also remembers the apps it started."""

    def __init__(self) -> None:
        from contextlib import AsyncExitStack

        self._stack = AsyncExitStack()
        self.apps: list[web.Application] = []

    async def __aenter__(self) -> _Stack:
        await self._stack.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.__aexit__(*exc)

    async def enter(self, cm: Any) -> Any:
        return await self._stack.enter_async_context(cm)
