"""A controllable test upstream: a real aiohttp server whose behaviour each test steers."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class UpstreamState:
    """What the test upstream saw, and the gates a test opens to pace it."""

    seen: list[dict[str, Any]] = field(default_factory=list)
    gates: list[asyncio.Event] = field(default_factory=lambda: [asyncio.Event() for _ in range(64)])
    sent: list[asyncio.Event] = field(default_factory=lambda: [asyncio.Event() for _ in range(64)])
    started: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)


STATE = web.AppKey("state", UpstreamState)
GZIPPED = gzip.compress(b'{"hello": "world"}' * 100, mtime=0)


async def echo(request: web.Request) -> web.Response:
    """Describe the request exactly as it arrived."""
    body = await request.read()
    described = {
        "method": request.method,
        "raw_path": request.raw_path,
        "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.raw_headers],
        "body_len": len(body),
        "body": body.decode("utf-8", "replace"),
        "body_sha256": hashlib.sha256(body).hexdigest(),
    }
    request.app[STATE].seen.append(described)
    return web.json_response(described, headers={"X-Upstream": "yes"})


async def strict_openai(request: web.Request) -> web.StreamResponse:
    """An engine with strict validation: `stream_options` is an unknown field, else a stream.

    It refuses the way FastAPI does (422) or, with `X-Refuse-With: 400`, the way engines with
    their own validation do (a plain 400 in OpenAI's error shape).
    """
    body = await request.read()
    request.app[STATE].seen.append({"body": body.decode()})
    if b"stream_options" in body:
        if request.headers.get("X-Refuse-With") == "400":
            error = {"message": "Unrecognized request argument supplied: stream_options", "code": 400}
            return web.json_response({"error": {**error, "type": "invalid_request_error"}}, status=400)
        return web.json_response({"detail": "extra fields not permitted: stream_options"}, status=422)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices":[{"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n')
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def mirror(request: web.Request) -> web.StreamResponse:
    """Stream the request body back as it comes (both directions streaming)."""
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    await response.prepare(request)
    async for chunk in request.content.iter_any():
        await response.write(chunk)
    await response.write_eof()
    return response


async def gzipped(request: web.Request) -> web.Response:
    """A gzip-encoded body the proxy must not decompress."""
    return web.Response(
        body=GZIPPED, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
    )


async def redirect(request: web.Request) -> web.Response:
    """A redirect the proxy must pass back, not follow."""
    return web.Response(status=302, headers={"Location": "/echo"})


async def hop_headers(request: web.Request) -> web.Response:
    """Hop-by-hop response headers the proxy must drop."""
    return web.Response(
        text="ok",
        headers={
            "Connection": "X-Private",
            "X-Private": "secret-hop",
            "Keep-Alive": "timeout=5",
            "X-Kept": "1",
            "Set-Cookie": "a=1",
        },
    )


async def paced_sse(request: web.Request) -> web.StreamResponse:
    """SSE events, each sent only after the test opens its gate."""
    state = request.app[STATE]
    count = int(request.query.get("n", "3"))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for index in range(count):
        await state.gates[index].wait()
        await response.write(f'data: {{"i": {index}}}\n\n'.encode())
        state.sent[index].set()
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def fast_sse(request: web.Request) -> web.StreamResponse:
    """N SSE events as fast as possible."""
    count = int(request.query.get("n", "100"))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for index in range(count):
        await response.write(f'data: {{"i": {index}}}\n\n'.encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def endless_sse(request: web.Request) -> web.StreamResponse:
    """One event, then silence until the client goes away (which must reach us)."""
    state = request.app[STATE]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    try:
        await response.write(b"data: first\n\n")
        state.started.set()
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        state.disconnected.set()
        raise
    return response


async def slow_head(request: web.Request) -> web.Response:
    """Answer only after a long time (the proxy's read timeout or the client's departure comes first)."""
    state = request.app[STATE]
    state.started.set()
    try:
        await asyncio.sleep(float(request.query.get("s", "3600")))
    except asyncio.CancelledError:
        state.disconnected.set()
        raise
    state.finished.set()
    return web.Response(text="late")


async def cut(request: web.Request) -> web.Response:
    """Drop the connection without answering."""
    assert request.transport is not None
    request.transport.abort()
    return web.Response(text="never sent")


async def cut_mid_body(request: web.Request) -> web.StreamResponse:
    """Send a head and part of a body, then drop the connection."""
    response = web.StreamResponse(headers={"Content-Length": "1000"})
    await response.prepare(request)
    await response.write(b"x" * 100)
    assert request.transport is not None
    request.transport.abort()
    return response


async def big(request: web.Request) -> web.Response:
    """A large deterministic body."""
    size = int(request.query.get("bytes", str(8 * 1024 * 1024)))
    return web.Response(body=bytes(range(256)) * (size // 256))


async def health(request: web.Request) -> web.Response:
    """The health path the sidecar probes."""
    return web.json_response({"status": "ok"})


def build_upstream() -> web.Application:
    """The test upstream app."""
    app = web.Application(client_max_size=1024**3)
    app[STATE] = UpstreamState()
    app.router.add_route("*", "/echo", echo)
    app.router.add_route("*", "/echo/{tail:.*}", echo)
    # An observed inference path that echoes, to see what the sidecar sent after observing.
    app.router.add_post("/v1/chat/completions", echo)
    app.router.add_post("/v1/completions", strict_openai)
    app.router.add_post("/mirror", mirror)
    app.router.add_get("/gzip", gzipped)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/hop", hop_headers)
    app.router.add_get("/sse/paced", paced_sse)
    app.router.add_get("/sse/fast", fast_sse)
    app.router.add_get("/sse/endless", endless_sse)
    app.router.add_get("/slow", slow_head)
    app.router.add_get("/cut", cut)
    app.router.add_get("/cut-mid-body", cut_mid_body)
    app.router.add_get("/big", big)
    app.router.add_get("/health", health)
    return app


def in_two_pieces(
    payload: object, pause_s: float = 0.2
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A handler that sends `payload` as JSON in two writes with a pause between (one answer, two reads)."""
    body = json.dumps(payload).encode()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "application/json", "Content-Length": str(len(body))}
        )
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
        await asyncio.sleep(pause_s)  # the pause is the behaviour under test
        await response.write(body[len(body) // 2 :])
        await response.write_eof()
        return response

    return handler
