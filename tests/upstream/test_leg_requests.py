"""What the forwarding leg (proxy/upstream) writes to the engine, and which connection it writes it on.

An engine mounted under a path gets its prefix; a POST without a body says `Content-Length: 0`;
a connection whose response came while the request body was still being written is never
pooled again (the engine would read the next request as the rest of that body); and requests
queued at `upstream_connection_limit` get connections first come, first served.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
from multidict import CIMultiDict

from proxy.upstream.body import write_body
from proxy.upstream.pools import UPSTREAM_LEG
from tests.support.hostile_engine import OK_JSON, HostileEngine, Script, hostile_engine, path_of, query_of
from tests.support.sidecar import SidecarFactory, serve_sidecar

TOO_LARGE = (
    b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: text/plain\r\nContent-Length: 9\r\n\r\ntoo large"
)


async def _until(predicate: Callable[[], bool], what: str) -> None:
    """Poll `predicate()` every 5 ms until it holds, within 10 s (`what` names it if it never does)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not predicate():
        assert loop.time() < deadline, f"never reached: {what}"
        await asyncio.sleep(0.005)


async def _ok(_: bytes, writer: asyncio.StreamWriter) -> bool:
    writer.write(OK_JSON)
    return True


def _holding(release: asyncio.Event) -> Script:
    """An engine that answers each request at once, but one to /hold only once `release` is set."""

    async def answer(head: bytes, writer: asyncio.StreamWriter) -> bool:
        if path_of(head) == "/hold":
            await release.wait()
        writer.write(OK_JSON)
        return True  # keep the connection

    return answer


async def _status(http: aiohttp.ClientSession, url: str) -> int:
    """GET `url` through the sidecar, read to its end; the status."""
    async with http.get(url) as response:
        await response.read()
        return response.status


async def test_an_engine_mounted_under_a_path_gets_its_prefix(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with hostile_engine(_ok) as engine:
        proxy = await sidecar(f"{engine.url}/serving/llm/", engine="vllm", health_interval=3600)
        async with http.get(f"{proxy}/v1/models?x=1") as response:
            assert response.status == 200
        forwarded = [head for head in engine.heads if query_of(head) == "x=1"]
        assert [path_of(head) for head in forwarded] == ["/serving/llm/v1/models"]


async def test_a_post_without_a_body_says_content_length_zero(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """The client's POST has neither Content-Length nor Transfer-Encoding (HTTP/1.1: an empty body)."""

    async with hostile_engine(_ok) as engine:
        proxy = await sidecar(engine.url, engine="vllm", health_interval=3600)
        host, port = proxy.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"POST /v1/load?bodiless HTTP/1.1\r\nHost: sidecar\r\n\r\n")
            async with asyncio.timeout(10):
                status_line = await reader.readline()
        finally:
            writer.close()
        assert status_line.startswith(b"HTTP/1.1 200")
        (head,) = [head for head in engine.heads if query_of(head) == "bodiless"]
        assert b"\r\nContent-Length: 0\r\n" in head
        assert b"Transfer-Encoding" not in head


async def test_an_empty_piece_of_a_streamed_body_does_not_end_its_chunked_framing() -> None:
    """`write_body` on a real connection: an empty piece is skipped, not framed as `0\\r\\n\\r\\n`,
    which would end the body there for the engine and make the rest a request of its own.

    The client's stream (proxy/forward/request_body.py) yields no empty piece today; this is
    the leg's own guard, for any stream handed to it."""
    received = asyncio.get_running_loop().create_future()

    async def collect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.set_result(await reader.read())
        writer.close()

    async def pieces() -> AsyncIterator[bytes]:
        for piece in (b"ab", b"", b"cd"):
            yield piece

    server = await asyncio.start_server(collect, "127.0.0.1", 0)
    try:
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        transport = writer.transport
        assert isinstance(transport, asyncio.Transport)
        marks = _Marks()
        await write_body(transport, pieces(), True, writer.drain, marks)
        writer.close()
        async with asyncio.timeout(10):
            assert await received == b"2\r\nab\r\n2\r\ncd\r\n0\r\n\r\n"
        # The terminator's marks: the stream's end in hand, then written (proxy/observe/overhead.py).
        assert 0 < marks.streamed_in_ns <= marks.sent_ns
    finally:
        server.close()


class _Marks:
    """Where `write_body` leaves its clock marks (the engine's response, in the leg)."""

    sent_ns = 0
    streamed_in_ns = 0


async def test_a_connection_answered_while_its_body_was_written_is_not_pooled(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """A 413 before the engine read the upload: the connection closes, the next request goes on a new one."""
    body = b"u" * (16 * 1024 * 1024)  # past the socket buffers: still being written when the 413 comes

    async def refuse_uploads(head: bytes, writer: asyncio.StreamWriter) -> bool:
        # Keep-alive, the body not yet read: the sidecar is still writing it.
        writer.write(TOO_LARGE if path_of(head) == "/upload" else OK_JSON)
        return True

    async with hostile_engine(refuse_uploads, answer_before_body=True) as engine:
        proxy = await sidecar(engine.url, engine="vllm", health_interval=3600, upstream_connection_limit=1)
        with contextlib.suppress(aiohttp.ClientError):  # the client may be cut while it still uploads
            async with http.post(
                f"{proxy}/upload", data=io.BytesIO(body), headers={"Content-Length": str(len(body))}
            ) as response:
                assert response.status == 413
        # Bounded: a request written onto that connection would wait behind the upload's body.
        async with asyncio.timeout(15), http.get(f"{proxy}/v1/models?after") as response:
            assert response.status == 200
    on = dict(zip(engine.heads, engine.connections, strict=True))
    (upload_on,) = [number for head, number in on.items() if path_of(head) == "/upload"]
    (next_on,) = [number for head, number in on.items() if query_of(head) == "after"]
    assert next_on != upload_on


async def test_requests_waiting_at_the_connection_limit_are_served_in_arrival_order(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()
    async with (
        hostile_engine(_holding(release)) as engine,
        serve_sidecar(
            engine.url, tmp_path, engine="vllm", health_interval=3600, upstream_connection_limit=1
        ) as sidecar,
    ):
        leg = sidecar.app[UPSTREAM_LEG]

        async def get(target: str) -> int:
            return await _status(http, f"{sidecar.url}{target}")

        def queued_now(count: int) -> Callable[[], bool]:
            return lambda: leg.queued == count

        held = asyncio.create_task(get("/hold"))
        await _until(lambda: any(path_of(head) == "/hold" for head in engine.heads), "the held request")
        queued = []
        for index in range(5):
            queued.append(asyncio.create_task(get(f"/v1/models?n={index}")))
            await _until(queued_now(index + 1), f"request {index} queued")
        release.set()
        assert await held == 200
        assert await asyncio.gather(*queued) == [200] * 5
    order = [query_of(head) for head in engine.heads if query_of(head).startswith("n=")]
    assert order == [f"n={index}" for index in range(5)]


def _connection_of(engine: HostileEngine, query: str) -> int:
    """The number of the connection the request with this query came on."""
    (number,) = [
        n for head, n in zip(engine.heads, engine.connections, strict=True) if query_of(head) == query
    ]
    return number


async def test_keepalive_0_hands_a_finished_connection_to_no_request_not_even_one_waiting(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """`upstream_keepalive_timeout = 0`: no connection serves twice, though a request waits at the limit
    when one is free again."""
    release = asyncio.Event()
    async with (
        hostile_engine(_holding(release)) as engine,
        serve_sidecar(
            engine.url,
            tmp_path,
            engine="vllm",
            health_interval=3600,
            upstream_connection_limit=1,
            upstream_keepalive_timeout=0,
        ) as sidecar,
    ):
        leg = sidecar.app[UPSTREAM_LEG]

        held = asyncio.create_task(_status(http, f"{sidecar.url}/hold?held"))
        await _until(lambda: any(query_of(head) == "held" for head in engine.heads), "the held request")
        waiting = asyncio.create_task(_status(http, f"{sidecar.url}/v1/models?waiting"))
        await _until(lambda: leg.queued == 1, "the second request queued at the limit")
        release.set()
        assert (await held, await waiting) == (200, 200)
    assert _connection_of(engine, "waiting") != _connection_of(engine, "held")


async def test_a_connection_idle_past_the_keepalive_is_not_reused_when_the_sweep_runs_late(
    tmp_path: Path,
) -> None:
    """The idle sweep is a timer: a loop kept busy past it (here blocked outright) runs it late, and a
    request in between must still not get the expired connection the engine may be closing."""
    async with (
        hostile_engine(_ok) as engine,
        serve_sidecar(
            engine.url, tmp_path, engine="vllm", health_interval=3600, upstream_keepalive_timeout=0.2
        ) as sidecar,
    ):
        leg = sidecar.app[UPSTREAM_LEG]
        for query in ("before", "after"):
            if query == "after":
                time.sleep(0.3)  # noqa: ASYNC251  # the loop blocked past the keep-alive: no sweep ran
            response = await leg.send("GET", f"/v1/models?{query}", CIMultiDict(), None)
            try:
                assert response.status == 200
                while await response.read():
                    pass
            finally:
                response.close()
    assert _connection_of(engine, "after") != _connection_of(engine, "before")
