"""Shared fixtures: serve real aiohttp apps on loopback ports for each test."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from proxy.app import build_app
from proxy.config import SETTINGS, Settings
from proxy.serve import make_runner, make_site
from proxy.sim import SimConfig
from tests.sim_helpers import Sim, chat, sim, words

# Property tests (hypothesis). A failing example is saved to the example database and is
# replayed first on every later run until it passes; CI may keep the database between runs
# by pointing CACHEWITNESS_HYPOTHESIS_DB at a cached directory, and prints each failure's
# reproduction blob (`@reproduce_failure`) in the log either way. `dev` (the default) runs
# a few hundred examples per property; `ci` (`make test`: --hypothesis-profile=ci) 10,000.
# No deadline: one example may carry a 2 MiB event, and a timing is not a failure.
_EXAMPLES = DirectoryBasedExampleDatabase(
    os.environ.get("CACHEWITNESS_HYPOTHESIS_DB", ".hypothesis/examples")
)
_SLOW_DATA = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "dev", max_examples=300, deadline=None, database=_EXAMPLES, suppress_health_check=_SLOW_DATA
)
settings.register_profile(
    "ci",
    max_examples=10_000,
    deadline=None,
    database=_EXAMPLES,
    print_blob=True,
    suppress_health_check=_SLOW_DATA,
)
settings.load_profile("dev")


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


def non_loopback_ipv4() -> str | None:
    """One of this machine's own non-loopback IPv4 addresses (traffic to it never leaves the machine)."""
    candidates: list[str] = []
    try:
        candidates += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    for target in ("192.0.2.1", "10.254.254.254"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))  # UDP connect sends nothing; it only picks the source address
                candidates.append(probe.getsockname()[0])
        except OSError:
            pass
    for address in candidates:
        if not ipaddress.ip_address(address).is_loopback:
            return address
    return None


@pytest.fixture
def remote_host() -> str:
    """A non-loopback address of this machine to bind a sidecar on (skips without one)."""
    address = non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    return address


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


@dataclass(frozen=True)
class Sidecar:
    """A sidecar under test: its URL and its app (for looking at its objects)."""

    url: str
    app: web.Application


@asynccontextmanager
async def serve_sidecar(
    upstream: str, tmp_path: Path, *, host: str = "127.0.0.1", port: int = 0, **overrides: Any
) -> AsyncIterator[Sidecar]:
    """The one way tests build a sidecar: `build_app` for `upstream`, served by serve.py's runner."""
    app = build_app(make_settings(upstream, tmp_path, **overrides))
    async with serve_app(app, host, port) as url:
        yield Sidecar(url, app)


@dataclass(frozen=True)
class Stack:
    """A simulator, a sidecar in front of it, the sidecar's app, and a client."""

    engine: Sim
    url: str
    app: web.Application
    http: aiohttp.ClientSession

    async def reset(self, body: dict[str, Any] | None = None, query: str = "") -> tuple[int, dict[str, Any]]:
        """POST /cache/reset; status and JSON body."""
        data = orjson.dumps(body) if body is not None else None
        async with self.http.post(f"{self.url}/cache/reset{query}", data=data) as resp:
            return resp.status, await resp.json()

    async def chat(self, max_tokens: int, content: str = "hello") -> int:
        """A chat completion through the sidecar; its status."""
        async with self.http.post(
            f"{self.url}/v1/chat/completions", json=chat(words(8, content), max_tokens)
        ) as r:
            await r.read()
            return r.status


@asynccontextmanager
async def stack(
    config: SimConfig, tmp_path: Path, *, host: str = "127.0.0.1", **overrides: Any
) -> AsyncIterator[Stack]:
    """A simulator with a sidecar in front of it, on real loopback sockets."""
    async with (
        sim(config) as engine,
        serve_sidecar(engine.url, tmp_path, host=host, **overrides) as sidecar,
        aiohttp.ClientSession() as http,
    ):
        yield Stack(engine, sidecar.url, sidecar.app, http)


@asynccontextmanager
async def running_request(
    s: Stack, max_tokens: int = 5000, content: str = "hello"
) -> AsyncIterator[asyncio.Task[int]]:
    """A chat generating at the engine for the whole block (the busy engine a reset meets).

    At the end of the block it is cancelled unless it already finished.
    """
    request = asyncio.create_task(s.chat(max_tokens, content))
    await s.engine.wait_stats(lambda st: st["running"] >= 1)
    try:
        yield request
    finally:
        if not request.done():
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request


SidecarFactory = Callable[..., Awaitable[str]]


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[SidecarFactory]:
    """Start sidecars in front of a given upstream: `url = await sidecar(upstream, **settings)`."""
    async with AsyncExitStack() as started:

        async def start(upstream: str, **overrides: Any) -> str:
            return (await started.enter_async_context(serve_sidecar(upstream, tmp_path, **overrides))).url

        yield start
