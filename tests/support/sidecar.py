"""Serve real aiohttp apps on loopback ports: a sidecar built by build_app, a simulator in front, a client."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.app import build_app
from proxy.config import SETTINGS, Settings
from proxy.forward.injection_probe import INJECTION_PROBE
from proxy.serve import make_runner, make_site
from proxy.sim import SimConfig
from tests.support.client import CLIENT_TIMEOUT
from tests.support.sim import Sim, chat, sim, words


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
    port = runner.addresses[0][1]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def free_port() -> int:
    """A loopback port nothing listens on (until someone binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def closed_port_url() -> str:
    """A loopback URL nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


def non_loopback_ipv4() -> str | None:
    """One of this machine's own non-loopback IPv4 addresses (traffic to it never leaves the machine)."""
    candidates: list[str] = []
    with contextlib.suppress(OSError):
        candidates += [
            str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        ]
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
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
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


async def injection_probes_done(app: web.Application, runs: int) -> None:
    """Wait (bounded) until the sidecar's injection probe, which runs in the background, has
    finished `runs` probes; then exactly that many."""
    probe = app[INJECTION_PROBE]
    for _ in range(200):
        if probe.runs >= runs:
            break
        await asyncio.sleep(0.05)
    assert probe.runs == runs
