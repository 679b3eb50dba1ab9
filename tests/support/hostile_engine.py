"""An engine that writes whatever bytes a test scripts: the broken and hostile engines of issue 27.

Each request the sidecar sends is read whole (head and Content-Length body), then handed to
the test's `Script` with the connection's writer; the script writes its answer, any way it
likes (in pieces, endless, followed by stray bytes), and says whether to keep the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    # Set when the sidecar closed a connection: while the engine wrote, or while it waited for a request.
    cut: asyncio.Event = field(default_factory=asyncio.Event)


def path_of(head: bytes) -> str:
    """The path of a request head, without its query."""
    return head.split(b" ", 2)[1].partition(b"?")[0].decode()


def query_of(head: bytes) -> str:
    """The query of a request head ('' when none)."""
    return head.split(b" ", 2)[1].partition(b"?")[2].decode()


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request head (its Content-Length body read and dropped); None when the peer closed first."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                await reader.readexactly(int(value))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return head


@contextlib.asynccontextmanager
async def hostile_engine(script: Script) -> AsyncIterator[HostileEngine]:
    """Serve `script` on a loopback port until the block ends."""
    engine = HostileEngine(url="")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (head := await _read_request(reader)) is not None:
                engine.heads.append(head)
                try:
                    keep = await script(head, writer)
                    await writer.drain()
                except ConnectionError:
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
