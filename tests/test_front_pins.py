"""Connection behaviours of the front pinned through `python -m proxy serve` (issue 45): a graceful
shutdown's answers say `Connection: close`, and an upload the sidecar itself paused is not cut as silent.

The engine is a raw asyncio server the test paces: it holds an answer, or leaves a body unread.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.process import BOUND_S, open_raw, start_sidecar, stop

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@dataclass
class _Engine:
    """What the raw engine is told and tells: a POST to /held waits for `release`; a body is read
    only after `read_after_s` (the sidecar's upload then backs up to its client)."""

    url: str = ""
    release: asyncio.Event = field(default_factory=asyncio.Event)
    held: asyncio.Event = field(default_factory=asyncio.Event)
    read_after_s: float = 0.0
    bodies: list[int] = field(default_factory=list)


async def _body(reader: asyncio.StreamReader, head: bytes) -> int:
    """Read the body of `head` (by its length, or chunked); its size."""
    lowered = head.lower()
    if b"content-length:" in lowered:
        length = int(lowered.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        await reader.readexactly(length)
        return length
    if b"transfer-encoding: chunked" not in lowered:
        return 0
    size = 0
    while chunk := int((await reader.readuntil(b"\r\n")).strip(), 16):
        await reader.readexactly(chunk + 2)
        size += chunk
    await reader.readuntil(b"\r\n")
    return size


@asynccontextmanager
async def _engine() -> AsyncIterator[_Engine]:
    engine = _Engine()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                if head.startswith(b"POST /held "):
                    engine.held.set()
                    await engine.release.wait()
                if head.startswith(b"POST /upload "):
                    await asyncio.sleep(engine.read_after_s)  # the body backs up meanwhile
                size = await _body(reader, head)
                if head.startswith(b"POST "):
                    engine.bodies.append(size)
                writer.write(_OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    engine.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        yield engine


async def test_an_answer_during_a_graceful_shutdown_says_connection_close(tmp_path: Path) -> None:
    """A keep-alive request the front serves while SIGTERM's shutdown runs: its answer says
    `Connection: close`, and the connection then closes (a client would otherwise reuse it)."""
    async with _engine() as engine:
        process, url = await start_sidecar(
            engine.url, tmp_path, "--engine", "generic", "--shutdown-delay", "0.2", "--grace-period", "20"
        )
        try:
            reader, writer = await open_raw(
                url, b"POST /held HTTP/1.1\r\nHost: s\r\nContent-Length: 2\r\n\r\n{}"
            )
            await asyncio.wait_for(engine.held.wait(), BOUND_S)
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(
                1.0
            )  # past shutdown_delay: the listener is closed, shutdown waits on this request
            engine.release.set()
            answer = await asyncio.wait_for(reader.read(), BOUND_S)  # all of it: the sidecar closes
            writer.close()
            assert await asyncio.wait_for(process.wait(), BOUND_S) == 0
        finally:
            if process.returncode is None:
                await stop(process)
    head = answer.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 200 "), answer
    assert b"\r\nconnection: close" in head, answer


async def test_an_upload_the_sidecar_paused_is_not_cut_as_silent(tmp_path: Path) -> None:
    """A 32 MiB upload streamed to an engine that reads nothing for 3 s: the sidecar stops reading
    its client (flow control), which is not the client's silence nor its slowness: neither
    body_idle_timeout (1 s) nor body_timeout (2 s) cuts it."""
    size = 32 * 1024 * 1024
    async with _engine() as engine:
        engine.read_after_s = 3.0
        process, url = await start_sidecar(
            engine.url,
            tmp_path,
            "--engine",
            "generic",
            "--body-idle-timeout",
            "1",
            "--body-timeout",
            "2",  # the body takes 3 s and more in all, all of it the sidecar's pause
            "--max-buffered-bytes",
            "0",  # every body streams to the engine as it comes
        )
        try:
            head = f"POST /upload HTTP/1.1\r\nHost: s\r\nConnection: close\r\nContent-Length: {size}\r\n\r\n"
            reader, writer = await open_raw(url, head.encode())
            sending = asyncio.create_task(_send(writer, size))
            answer = await asyncio.wait_for(reader.read(), BOUND_S)
            writer.close()
            await asyncio.wait_for(asyncio.gather(sending, return_exceptions=True), BOUND_S)
        finally:
            await stop(process)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert engine.bodies == [size]


async def _send(writer: asyncio.StreamWriter, size: int) -> None:
    """`size` bytes as fast as the sidecar takes them."""
    piece = b"x" * (1024 * 1024)
    for _ in range(size // len(piece)):
        writer.write(piece)
        await writer.drain()
