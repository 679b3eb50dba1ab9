"""The forwarding leg's own HTTP (proxy/upstream): pooling, limits, timeouts and answers aiohttp used to frame.

The suite as a whole proves the leg forwards as the ClientSession did; these pin what the
leg does itself: the connection limit, the idle sweep, the lazy read timer, flow control, HEAD,
1xx answers, bodies that end with the connection, and bytes that are not HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from proxy.upstream import UpstreamLeg
from tests.support.sidecar import SidecarFactory, serve_app

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class RawEngine:
    """A TCP server that answers with bytes each test writes by hand."""

    url: str
    heads: list[bytes] = field(default_factory=list)
    # The request heads each connection carried, for connections the sidecar closed while idle.
    closed_by_peer: list[list[bytes]] = field(default_factory=list)


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request head and its Content-Length body; None when the peer closed first."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            await reader.readexactly(int(value))
    return head


@contextlib.asynccontextmanager
async def raw_engine(
    reply: Callable[[bytes], bytes], *, close_after: bool = False
) -> AsyncIterator[RawEngine]:
    """Serve `reply(request_head)` to every request; `close_after`: close each connection after one answer."""
    engine = RawEngine(url="")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        carried: list[bytes] = []
        try:
            while (head := await _read_request(reader)) is not None:
                engine.heads.append(head)
                carried.append(head)
                writer.write(reply(head))
                await writer.drain()
                if close_after:
                    return
            engine.closed_by_peer.append(carried)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    engine.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield engine
    finally:
        server.close()


OK_JSON = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'


async def _counted(http: aiohttp.ClientSession, proxy: str, name: str) -> float:
    """A sidecar counter summed over its series."""
    async with http.get(f"{proxy}/metrics") as response:
        text = await response.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


async def test_a_head_request_ends_at_the_head(
    sidecar: SidecarFactory, upstream: str, http: aiohttp.ClientSession
) -> None:
    # The engine states the length of the body a GET would get, and sends none: llhttp alone
    # would wait for those bytes until read_timeout, and the exchange would not end before.
    proxy = await sidecar(upstream, read_timeout=60)
    async with http.head(f"{proxy}/echo") as response:
        assert response.status == 200
        assert int(response.headers["Content-Length"]) > 0
    for _ in range(40):  # bounded: 2 s
        if await _counted(http, proxy, "cachewitness_requests_total") == 1:
            break
        await asyncio.sleep(0.05)
    assert await _counted(http, proxy, "cachewitness_requests_total") == 1
    assert await _counted(http, proxy, "cachewitness_upstream_errors_total") == 0
    async with http.get(f"{proxy}/echo") as response:
        assert response.status == 200
        assert (await response.json())["method"] == "GET"


async def test_an_informational_answer_is_skipped_for_the_real_one(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    def reply(_: bytes) -> bytes:
        return b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n" + OK_JSON

    async with raw_engine(reply) as engine:
        proxy = await sidecar(engine.url, engine="vllm", health_interval=3600)
        async with http.get(f"{proxy}/v1/models") as response:
            assert response.status == 200
            assert await response.read() == b'{"ok":true}'


async def test_a_body_that_ends_with_the_connection_arrives_whole(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    body = b"x" * 200_000

    def reply(_: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n" + body

    async with raw_engine(reply, close_after=True) as engine:
        proxy = await sidecar(engine.url, engine="vllm", health_interval=3600)
        for _ in range(2):  # and the closed connection is not reused
            async with http.get(f"{proxy}/v1/models") as response:
                assert response.status == 200
                assert await response.read() == body


async def test_an_answer_that_is_not_http_is_502_and_the_sidecar_keeps_serving(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    def reply(head: bytes) -> bytes:
        return b"SSH-2.0-OpenSSH_9.6\r\n\r\n" if b"?broken" in head else OK_JSON

    async with raw_engine(reply) as engine:
        proxy = await sidecar(engine.url, engine="vllm", health_interval=3600)
        async with http.get(f"{proxy}/v1/models?broken") as response:
            assert response.status == 502
            error = (await response.json())["error"]
            assert error["code"] == "upstream_bad_answer"
            assert "not valid HTTP" in error["message"]
        async with http.get(f"{proxy}/v1/models") as response:
            assert response.status == 200


_CHUNKS = (
    b'{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}',
    b'{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
    b'{"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}',
)


def _capitalised_stream(_: bytes) -> bytes:
    body = b"".join(b"data: %b\n\n" % chunk for chunk in _CHUNKS) + b"data: [DONE]\n\n"
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: Text/Event-Stream; charset=utf-8\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )


async def test_a_media_type_in_capitals_is_the_same_media_type(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """`Text/Event-Stream` is an SSE answer (media types are case-insensitive): its usage is read, and
    the usage chunk the sidecar asked for on the client's behalf is taken out again."""
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with raw_engine(_capitalised_stream) as engine:
        proxy = await sidecar(engine.url, engine="vllm", health_interval=3600)
        async with http.post(f"{proxy}/v1/chat/completions", json=request) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "Text/Event-Stream; charset=utf-8"
            body = await response.read()
        async with http.get(
            f"{proxy}/cache/evidence", params={"event_type": "infer.cache_observation"}
        ) as got:
            (observation,) = [orjson.loads(line) for line in (await got.read()).splitlines()]
    assert (
        b'"content":"hi"' in body and b'"finish_reason":"stop"' in body and body.endswith(b"data: [DONE]\n\n")
    )
    assert b"usage" not in body  # the client did not ask for it
    assert (observation["usage_injected"], observation["prompt_tokens"]) == (True, 5)


async def test_the_connection_limit_bounds_upstream_connections_and_every_request_is_answered(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    in_flight: list[int] = [0, 0]  # now, most at once

    async def slow(request: web.Request) -> web.Response:
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        await asyncio.sleep(0.2)
        in_flight[0] -= 1
        return web.json_response({"ok": True})

    engine = web.Application()
    engine.router.add_get("/v1/models", slow)
    async with serve_app(engine) as url:
        proxy = await sidecar(url, engine="vllm", health_interval=3600, upstream_connection_limit=2)

        async def one() -> int:
            async with http.get(f"{proxy}/v1/models") as response:
                await response.read()
                return response.status

        statuses = await asyncio.gather(*(one() for _ in range(6)))
    assert statuses == [200] * 6
    assert in_flight[1] == 2


async def test_idle_connections_are_closed_after_the_keepalive_without_further_traffic(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with raw_engine(lambda _: OK_JSON) as engine:
        proxy = await sidecar(engine.url, engine="vllm", health_interval=3600, upstream_keepalive_timeout=0.2)
        async with http.get(f"{proxy}/v1/models?forwarded") as response:
            assert response.status == 200

        def closed() -> bool:
            return any(b"?forwarded" in head for carried in engine.closed_by_peer for head in carried)

        assert not closed()
        for _ in range(40):  # bounded: 2 s
            if closed():
                break
            await asyncio.sleep(0.05)
        assert closed()


async def test_an_engine_sending_slower_than_read_timeout_between_events_is_not_cut(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """read_timeout is silence between reads, not the length of the answer."""

    async def paced(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(6):
            await asyncio.sleep(0.2)
            await response.write(f"data: {index}\n\n".encode())
        await response.write_eof()
        return response

    engine = web.Application()
    engine.router.add_get("/paced", paced)
    async with serve_app(engine) as url:
        proxy = await sidecar(url, engine="vllm", health_interval=3600, read_timeout=0.5)
        async with http.get(f"{proxy}/paced") as response:
            body = await response.read()
    assert body == b"".join(f"data: {index}\n\n".encode() for index in range(6))


BIG = 48 * 1024 * 1024  # past the socket buffers on both sides of the sidecar


def _big_engine() -> tuple[web.Application, list[int]]:
    """An engine answering GET /big with BIG bytes, 1 MiB a write; what it got rid of so far."""
    piece = b"z" * (1024 * 1024)
    written = [0]

    async def big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = BIG
        await response.prepare(request)
        for _ in range(BIG // len(piece)):
            await response.write(piece)
            written[0] += len(piece)
        await response.write_eof()
        return response

    engine = web.Application()
    engine.router.add_get("/big", big)
    return engine, written


async def test_a_client_reading_slowly_pauses_the_engine_without_a_read_timeout(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """Flow control: the sidecar stops reading while the client is behind, and that is not the engine's silence."""
    size = BIG
    engine, written = _big_engine()
    async with serve_app(engine) as url:
        proxy = await sidecar(url, engine="vllm", health_interval=3600, read_timeout=0.4)
        async with asyncio.timeout(60), http.get(f"{proxy}/big") as response:
            assert response.status == 200
            await asyncio.sleep(1.2)  # the client falls behind, three read timeouts long
            # The sidecar holds a bounded amount, not the answer: the engine is stuck writing
            # (socket buffers on loopback hold a few MiB; unbounded, all 48 go in well under 1 s).
            assert written[0] < size // 2
            received = 0
            async for chunk in response.content.iter_any():
                received += len(chunk)
    assert received == size


async def test_a_response_read_slowly_with_read_pauses_the_engine() -> None:
    """The leg's own flow control, for a consumer that takes the body with `read()` (as `peek` does)
    rather than relaying it: what is not taken stops reading from the engine at HIGH_WATER."""
    engine, written = _big_engine()
    async with serve_app(engine) as url:
        leg = UpstreamLeg(url, connect_timeout=5, read_timeout=0, keepalive=4, limit=0)
        try:
            response = await leg.send("GET", "/big", CIMultiDict(), None)
            try:
                async with asyncio.timeout(60):
                    await asyncio.sleep(1.0)  # nothing taken: unbounded, all 48 MiB go in well under 1 s
                    assert written[0] < BIG // 2
                    received = 0
                    while chunk := await response.read():
                        received += len(chunk)
            finally:
                response.close()
        finally:
            leg.close()
    assert received == BIG


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made with the openssl command line."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command line to make a certificate")
    cert, key = directory / "engine.crt", directory / "engine.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_an_https_engine_is_reached_over_verified_tls(
    sidecar: SidecarFactory, http: aiohttp.ClientSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`upstream = https://...`: the leg speaks TLS and verifies the engine against the trusted CAs."""
    cert, key = _self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [], "tls": request.secure})

    engine = web.Application()
    engine.router.add_get("/v1/models", models)
    runner = web.AppRunner(engine)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = runner.addresses[0][1]
    try:
        untrusted = await sidecar(f"https://127.0.0.1:{port}", engine="vllm", health_interval=3600)
        async with http.get(f"{untrusted}/v1/models") as response:
            assert response.status == 502  # a certificate no trusted CA signed is refused
        # The default verify paths honour SSL_CERT_FILE: trust this engine's certificate.
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        trusted = await sidecar(f"https://127.0.0.1:{port}", engine="vllm", health_interval=3600)
        async with http.get(f"{trusted}/v1/models") as response:
            assert response.status == 200
            assert (await response.json())["tls"] is True
    finally:
        await runner.cleanup()
