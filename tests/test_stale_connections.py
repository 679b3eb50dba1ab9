"""Pooled upstream connections the engine has closed: resets sent again (issue 13, item 4), and a
forwarded request the engine may have read never sent twice (issue 27, L2)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler
from multidict import CIMultiDict

from proxy.upstream import UpstreamLeg
from tests.support.hostile_engine import OK_JSON
from tests.support.sidecar import SidecarFactory, serve_app

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
ROUNDS = 6


@dataclass
class Connections:
    """What the engine saw of the sidecar's connections."""

    # Connections that answered one request already (held, so that no new one can take their id).
    served: set[asyncio.BaseTransport] = field(default_factory=set)
    fresh: list[str] = field(default_factory=list)  # paths of requests that came on a new connection
    dropped: list[str] = field(default_factory=list)  # paths of requests on an old one, closed unanswered


CONNECTIONS = web.AppKey("connections", Connections)


def closes_every_idle_connection() -> web.Application:
    """An engine that has always just closed a connection it served before (uvicorn's idle close, lost race).

    A request that comes on a connection that already served one is never answered:
    the connection closes as if the engine's keep-alive timer had fired just before.
    """
    seen = Connections()

    @web.middleware
    async def stale_after_first(request: web.Request, handler: Handler) -> web.StreamResponse:
        assert request.transport is not None
        connection = request.transport
        if connection in seen.served:
            seen.dropped.append(request.path)
            request.transport.close()
            raise asyncio.CancelledError  # no answer on this connection
        seen.served.add(connection)
        seen.fresh.append(request.path)
        return await handler(request)

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    async def reset(request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def empty(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[stale_after_first])
    app[CONNECTIONS] = seen
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/reset_prefix_cache", reset)
    app.router.add_post("/v1/empty", empty)
    return app


async def test_a_reset_on_a_stale_pooled_connection_is_sent_again_not_unreachable(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """The sidecar's own reset call (aiohttp's pool, proxy/upstream/resend.py): a reset is one to repeat."""
    engine = closes_every_idle_connection()
    async with serve_app(engine) as upstream:
        proxy = await sidecar(upstream, engine="vllm", health_interval=3600)
        statuses = []
        for _ in range(ROUNDS):
            async with http.post(f"{proxy}/cache/reset", json={"retry_seconds": 0}) as response:
                await response.read()
                statuses.append(response.status)
    seen = engine[CONNECTIONS]
    assert statuses == [200] * ROUNDS  # acknowledged, not unreachable
    assert seen.dropped.count("/reset_prefix_cache") >= ROUNDS - 1  # the pool did hand out stale connections
    assert seen.fresh.count("/reset_prefix_cache") == ROUNDS  # and each reset was answered on a fresh one


@pytest.mark.parametrize(("path", "body"), [("/v1/empty", None), ("/v1/chat/completions", CHAT)])
async def test_a_forwarded_request_the_engine_read_before_closing_is_sent_once_and_is_502(
    sidecar: SidecarFactory, http: aiohttp.ClientSession, path: str, body: dict[str, Any] | None
) -> None:
    """The engine read the request on a reused connection, then closed it unanswered: it may have
    acted on it, so it is not sent again (a body-less POST was, issue 27 L2); the client gets a 502."""
    engine = closes_every_idle_connection()
    async with serve_app(engine) as upstream:
        proxy = await sidecar(upstream, engine="vllm", health_interval=3600)
        statuses = []
        for _ in range(2):  # the first on a fresh connection, the second on it again
            async with http.post(f"{proxy}{path}", json=body) as response:
                await response.read()
                statuses.append(response.status)
    seen = engine[CONNECTIONS]
    assert statuses == [200, 502]
    # One copy of each request reached the engine (the sidecar's own calls come on other connections).
    assert (seen.fresh.count(path), seen.dropped.count(path)) == (1, 1)


def drops_every_request(path: str) -> tuple[web.Application, list[str]]:
    """An engine that reads each POST to `path` and closes its connection unanswered; the paths it read."""
    tries: list[str] = []

    async def drop(request: web.Request) -> web.Response:
        tries.append(request.path)
        assert request.transport is not None
        request.transport.close()
        raise asyncio.CancelledError

    engine = web.Application()
    engine.router.add_post(path, drop)
    return engine, tries


async def test_a_fresh_connection_that_fails_is_not_sent_again(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """Only a reused connection is presumed stale: an engine that drops a new one gets one try, and a 502."""
    engine, tries = drops_every_request("/v1/chat/completions")
    async with serve_app(engine) as upstream:
        # Keep-alive 0: nothing is pooled, every connection is a new one.
        proxy = await sidecar(upstream, engine="vllm", health_interval=3600, upstream_keepalive_timeout=0)
        async with http.post(f"{proxy}/v1/chat/completions", json=CHAT) as response:
            assert response.status == 502
    assert tries == ["/v1/chat/completions"]


async def test_a_reset_whose_fresh_connection_fails_is_not_sent_again(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """The sidecar's own calls (proxy/upstream/resend.py): an engine that reads the reset on a new
    connection and closes it unanswered gets that reset once; the failure is the engine's, not a stale pool's."""
    engine, tries = drops_every_request("/reset_prefix_cache")
    async with serve_app(engine) as upstream:
        # Keep-alive 0: nothing is pooled, every connection is a new one.
        proxy = await sidecar(upstream, engine="vllm", health_interval=3600, upstream_keepalive_timeout=0)
        async with http.post(f"{proxy}/cache/reset", json={"retry_seconds": 0, "verify": "none"}) as response:
            body = await response.json()
    assert body["success"] is False, body
    assert tries == ["/reset_prefix_cache"]


async def test_idle_connections_leave_the_pool_after_upstream_keepalive_timeout(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    engine = closes_every_idle_connection()
    async with serve_app(engine) as upstream:
        proxy = await sidecar(upstream, engine="vllm", health_interval=3600, upstream_keepalive_timeout=0.05)
        for _ in range(3):
            await asyncio.sleep(0.15)  # idle past the pool's keep-alive: the pool drops the connection
            async with http.post(f"{proxy}/v1/chat/completions", json=CHAT) as response:
                assert response.status == 200
    seen = engine[CONNECTIONS]
    path = "/v1/chat/completions"
    assert (seen.fresh.count(path), seen.dropped.count(path)) == (3, 0)


class ThreadedEngine:
    """An engine on blocking sockets in its own thread: it can close a connection while the
    test's loop is held, which no engine sharing that loop can."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        self.requests = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # the server socket closed
            while True:
                connection, _ = self._server.accept()
                self.connections.append(connection)
                threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while connection.recv(65536).endswith(b"\r\n\r\n"):  # a body-less request per read
                self.requests += 1
                connection.sendall(OK_JSON)

    def close_connections(self) -> None:
        """Close every connection from the engine's side, now (the test's loop waits meanwhile)."""
        for connection in self.connections:
            connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def close(self) -> None:
        self._server.close()
        for connection in self.connections:  # the fresh one too: an unclosed socket warns in a later test
            connection.close()


async def test_a_pooled_connection_the_engine_closed_is_not_written_to() -> None:
    """The engine closed an idle connection, and the loop has not seen it yet (the race of uvicorn's
    idle close): the leg finds the close in the kernel before writing, and the request goes, once,
    on a fresh connection. Through the leg itself: only holding the loop makes the race certain."""
    engine = ThreadedEngine()
    leg = UpstreamLeg(engine.url, connect_timeout=5, read_timeout=5, keepalive=60, limit=0)
    try:
        for round_ in range(2):
            answer = await leg.send("POST", "/v1/empty", CIMultiDict(), None)
            assert (answer.status, await answer.peek(100)) == (200, b'{"ok":true}')
            answer.close()
            if round_ == 0:
                engine.close_connections()
                time.sleep(0.05)  # noqa: ASYNC251  # holds the loop: the engine's FIN is in the kernel, unseen by the pool
    finally:
        leg.close()
        engine.close()
    assert (engine.requests, len(engine.connections)) == (2, 2)
