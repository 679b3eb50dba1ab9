"""A capturing upstream: a real HTTP hop in front of an engine that writes down every request it passes on.

Tests put it between the sidecar and the simulator to see exactly what reached the engine
(paths, methods, headers, bodies) without changing either of them, or to answer a request in
the engine's place.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from yarl import URL

from tests.support.client import CLIENT_TIMEOUT
from tests.support.sidecar import serve_app

_CLIENT = web.AppKey("capture_client", aiohttp.ClientSession)
# Answers a request (its path and body) in the engine's place, or None to relay it.
Answer = Callable[[str, bytes], web.Response | None]
_HOP = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "content-length"})


@dataclass(frozen=True)
class Seen:
    """One request as it reached the engine."""

    method: str
    raw_path: str
    authorization: tuple[str, ...]
    headers: tuple[tuple[str, str], ...]
    body: bytes = b""


@dataclass
class Capture:
    """The capturing hop's URL and what it saw."""

    url: str
    seen: list[Seen] = field(default_factory=list)

    def paths(self) -> list[str]:
        """`METHOD raw_path` of every request seen, in order."""
        return [f"{s.method} {s.raw_path}" for s in self.seen]


@asynccontextmanager
async def capturing(target: str, port: int = 0, answer: Answer | None = None) -> AsyncIterator[Capture]:
    """Serve a hop that records each request and relays it to `target`, streaming the answer back.

    `port`: where it listens (0: a free port), for an upstream that comes up after its sidecar.
    `answer`: answers the requests it chooses itself (an engine that reads some bodies its own way).
    """
    app = web.Application()
    capture = Capture(url="")

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        capture.seen.append(
            Seen(
                method=request.method,
                raw_path=request.raw_path,
                authorization=tuple(request.headers.getall("Authorization", [])),
                headers=tuple(request.headers.items()),
                body=body,
            )
        )
        answered = answer(request.path, body) if answer is not None else None
        if answered is not None:
            return answered
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        client = request.app[_CLIENT]
        async with client.request(
            request.method,
            URL(target + request.raw_path, encoded=True),
            headers=headers,
            data=body or None,
            allow_redirects=False,
        ) as upstream:
            response = web.StreamResponse(status=upstream.status)
            for name, value in upstream.headers.items():
                if name.lower() not in _HOP:
                    response.headers.add(name, value)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def client_ctx(app: web.Application) -> AsyncIterator[None]:
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT, auto_decompress=False) as session:
            app[_CLIENT] = session
            yield

    app.cleanup_ctx.append(client_ctx)
    app.router.add_route("*", "/{tail:.*}", relay)
    async with serve_app(app, port=port) as url:
        capture.url = url
        yield capture
