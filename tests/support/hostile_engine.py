"""An engine that writes whatever bytes a test scripts: the broken and hostile engines of issue 27.

Each request the sidecar sends is read whole (head and Content-Length body), then handed to
the test's `Script` with the connection's writer; the script writes its answer, any way it
likes (in pieces, endless, followed by stray bytes), and says whether to keep the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

__all__ = ["OK_JSON", "HostileEngine", "Script", "hostile_engine", "path_of", "query_of"]

# Writes the answer to one request (its head); True keeps the connection for the next request.
Script = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]

OK_JSON = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'


@dataclass
class HostileEngine:
    """Where the engine listens, and what it saw."""

    url: str
    heads: list[bytes] = field(default_factory=list)  # every request head, in arrival order
    connections: list[int] = field(default_factory=list)  # the number of the connection each came on
    # Set when the sidecar closed a connection: while the engine wrote, or while it waited for a request.
    cut: asyncio.Event = field(default_factory=asyncio.Event)


def path_of(head: bytes) -> str:
    """The path of a request head, without its query."""
    return head.split(b" ", 2)[1].partition(b"?")[0].decode()


def query_of(head: bytes) -> str:
    """The query of a request head ('' when none)."""
    return head.split(b" ", 2)[1].partition(b"?")[2].decode()


def _length(head: bytes) -> int:
    """The Content-Length of a request head (0 without one)."""
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    """One request head; None when the peer closed first."""
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bool:
    """Read and drop the head's Content-Length body; False when the peer closed first."""
    try:
        await reader.readexactly(_length(head))
    except (asyncio.IncompleteReadError, ConnectionError):
        return False
    return True


@contextlib.asynccontextmanager
async def hostile_engine(script: Script, *, answer_before_body: bool = False) -> AsyncIterator[HostileEngine]:
    """Serve `script` on a loopback port until the block ends; with `answer_before_body` the script
    answers each request before its body is read (as an engine refusing an upload at its head)."""
    engine = HostileEngine(url="")
    numbers = itertools.count()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = next(numbers)
        try:
            while (head := await _read_head(reader)) is not None:
                if not answer_before_body and not await _read_body(reader, head):
                    break
                engine.heads.append(head)
                engine.connections.append(number)
                try:
                    keep = await script(head, writer)
                    await writer.drain()
                except ConnectionError:
                    break
                if answer_before_body and not await _read_body(reader, head):
                    break
                if not keep:
                    return
            engine.cut.set()
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    engine.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield engine
    finally:
        server.close()
