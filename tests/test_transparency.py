"""What the sidecar changes on the wire, and what it must not: encodings, lengths, retries, ids, Expect."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.support.client import CLIENT_TIMEOUT
from tests.support.sidecar import SidecarFactory, injection_probes_done, serve_app, serve_sidecar

USAGE = {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}


@dataclass
class Engine:
    """A small OpenAI-shaped engine whose misbehaviour each test picks."""

    seen: list[dict[str, Any]] = field(default_factory=list)
    refuse: tuple[int, bytes] | None = None  # answer to any request carrying stream_options
    error: tuple[int, bytes] | None = None  # answer to every request
    gzip_always: bool = False  # compress whatever Accept-Encoding says
    content_length: bool = False  # state the stream's length
    padding: int = 0  # bytes of content in a non-stream answer


ENGINE = web.AppKey("engine", Engine)


def stream_bytes(include_usage: bool) -> bytes:
    """The engine's stream: OpenAI's `"usage":null` members and usage chunk under include_usage."""
    null = ',"usage":null' if include_usage else ""
    events = [
        '{"id":"chatcmpl-engine1","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]'
        + null
        + "}",
        '{"id":"chatcmpl-engine1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]' + null + "}",
    ]
    if include_usage:
        events.append('{"id":"chatcmpl-engine1","choices":[],"usage":' + orjson.dumps(USAGE).decode() + "}")
    return b"".join(f"data: {event}\n\n".encode() for event in events) + b"data: [DONE]\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await request.read()
    engine.seen.append({"body": body, "headers": dict(request.headers)})
    if engine.error is not None:
        return web.Response(status=engine.error[0], body=engine.error[1], content_type="application/json")
    payload = orjson.loads(body)
    if engine.refuse is not None and "stream_options" in payload:
        return web.Response(status=engine.refuse[0], body=engine.refuse[1], content_type="application/json")
    if not payload.get("stream"):
        answer = {"id": "chatcmpl-engine2", "choices": [{"message": {"content": "x" * engine.padding}}]}
        return web.Response(body=orjson.dumps({**answer, "usage": USAGE}), content_type="application/json")
    include_usage = (payload.get("stream_options") or {}).get("include_usage") is True
    data = stream_bytes(include_usage)
    headers = {"Content-Type": "text/event-stream"}
    if engine.gzip_always:
        data = gzip.compress(data, mtime=0)
        headers["Content-Encoding"] = "gzip"
    if engine.content_length:
        headers["Content-Length"] = str(len(data))
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    await response.write(data)
    await response.write_eof()
    return response


async def health(request: web.Request) -> web.Response:
    return web.json_response({})


@pytest.fixture
async def engine_app() -> web.Application:
    app = web.Application()
    app[ENGINE] = Engine()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    return app


@pytest.fixture
async def engine(engine_app: web.Application) -> AsyncIterator[str]:
    async with serve_app(engine_app) as url:
        yield url


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT, auto_decompress=False) as session:
        yield session


STREAM = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


async def post(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> tuple[int, bytes]:
    async with client.post(
        url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
    ) as response:
        return response.status, await asyncio.wait_for(response.read(), timeout=10)


async def records(client: aiohttp.ClientSession, proxy: str) -> list[dict[str, Any]]:
    params = {"event_type": "infer.cache_observation"}
    async with client.get(proxy + "/cache/evidence", params=params) as response:
        return [orjson.loads(line) for line in (await response.read()).splitlines() if line]


async def test_an_error_that_does_not_name_stream_options_is_relayed_not_retried(
    sidecar: SidecarFactory, engine: str, engine_app: web.Application, client: aiohttp.ClientSession
) -> None:
    state = engine_app[ENGINE]
    state.error = (400, b'{"error":{"message":"context too long"}}')
    proxy = await sidecar(engine)
    assert await post(client, proxy, STREAM) == (400, b'{"error":{"message":"context too long"}}')
    assert len(state.seen) == 1


async def test_a_refusal_naming_stream_options_is_retried_once_and_remembered(
    engine: str, engine_app: web.Application, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    state = engine_app[ENGINE]
    state.refuse = (422, b'{"detail":"extra fields not permitted: stream_options"}')
    async with serve_sidecar(engine, tmp_path) as sidecar:
        proxy = sidecar.url
        assert await post(client, proxy, STREAM) == (200, stream_bytes(False))
        await injection_probes_done(sidecar.app, 1)
        assert await post(client, proxy, STREAM) == (200, stream_bytes(False))
        # One injected try and the client's own body; the sidecar's probe both ways (the
        # client's model: this engine lists none); then the client's own body: not asked again.
        sent = [(b"stream_options" in seen["body"], b'"max_tokens":1' in seen["body"]) for seen in state.seen]
        assert sent == [(True, False), (False, False), (True, True), (False, True), (False, False)]
        assert [r["usage_injected"] for r in await records(client, proxy)] == [False, False]


async def test_an_injected_request_asks_for_identity_encoding(
    sidecar: SidecarFactory, engine: str, engine_app: web.Application, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(engine)
    await post(client, proxy, STREAM, **{"Accept-Encoding": "gzip, deflate"})
    await post(client, proxy, {**STREAM, "stream": False}, **{"Accept-Encoding": "gzip, deflate"})
    injected, plain = engine_app[ENGINE].seen
    assert injected["headers"]["Accept-Encoding"] == "identity"
    assert plain["headers"]["Accept-Encoding"] == "gzip, deflate"


async def test_an_engine_compressing_an_injected_stream_answers_the_clients_own_request(
    engine: str, engine_app: web.Application, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    state = engine_app[ENGINE]
    state.gzip_always = True
    async with serve_sidecar(engine, tmp_path) as sidecar:
        proxy = sidecar.url
        status, body = await post(client, proxy, STREAM, **{"Accept-Encoding": "gzip"})
        assert status == 200 and gzip.decompress(body) == stream_bytes(False)
        # The probe's injected stream comes back compressed too: remembered, the next one sent as written.
        await injection_probes_done(sidecar.app, 1)
        assert await post(client, proxy, STREAM, **{"Accept-Encoding": "gzip"}) == (200, body)
        injected = [b"stream_options" in seen["body"] for seen in state.seen]
        assert injected == [True, False, True, False]
        first, _ = await records(client, proxy)
    assert first["usage_injected"] is False and first["cached_tokens"] is None


async def test_a_stripped_stream_carries_no_stale_content_length(
    sidecar: SidecarFactory, engine: str, engine_app: web.Application, client: aiohttp.ClientSession
) -> None:
    engine_app[ENGINE].content_length = True
    proxy = await sidecar(engine)
    async with client.post(proxy + "/v1/chat/completions", data=orjson.dumps(STREAM)) as response:
        body = await asyncio.wait_for(response.read(), timeout=10)
        length = response.headers.get("Content-Length")
    assert body == stream_bytes(False)
    assert length is None or int(length) == len(body)
    [record] = await records(client, proxy)
    assert record["usage_injected"] is True and record["cached_tokens"] == 4


async def test_the_engines_own_id_is_recorded_for_streams_and_json(
    sidecar: SidecarFactory, engine: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(engine)
    await post(client, proxy, STREAM)
    await post(client, proxy, {**STREAM, "stream": False})
    assert [r["engine_request_id"] for r in await records(client, proxy)] == [
        "chatcmpl-engine1",
        "chatcmpl-engine2",
    ]


async def test_usage_at_the_end_of_a_large_json_answer_is_read(
    sidecar: SidecarFactory, engine: str, engine_app: web.Application, client: aiohttp.ClientSession
) -> None:
    engine_app[ENGINE].padding = 8 * 1024 * 1024
    proxy = await sidecar(engine)
    status, body = await post(client, proxy, {**STREAM, "stream": False})
    assert status == 200 and len(body) > 8 * 1024 * 1024
    [record] = await records(client, proxy)
    assert (record["prompt_tokens"], record["cached_tokens"]) == (9, 4)
    assert record["engine_request_id"] == "chatcmpl-engine2"


async def _silent_on_expect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An HTTP/1.1 upstream that never sends `100 Continue`: it waits for the body, then answers."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
    await writer.drain()
    writer.close()


async def test_expect_100_continue_is_answered_by_the_sidecar_not_forwarded(
    sidecar: SidecarFactory, client: aiohttp.ClientSession
) -> None:
    server = await asyncio.start_server(_silent_on_expect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        proxy = await sidecar(f"http://127.0.0.1:{port}", engine="generic")
        body = orjson.dumps({**STREAM, "stream": False})

        async def exchange() -> tuple[int, bytes]:
            async with client.post(proxy + "/v1/chat/completions", data=body, expect100=True) as response:
                return response.status, await response.read()

        # Forwarded, the Expect header would have the sidecar wait for a 100 that never comes.
        assert await asyncio.wait_for(exchange(), timeout=10) == (200, b"{}")
