"""One response from the engine: its head once parsed, its body as it arrives, with flow control."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from multidict import CIMultiDict

__all__ = ["HIGH_WATER", "Carrier", "Sink", "UpstreamResponse"]

# Takes one body piece as it arrives; True when its reader is behind (stop reading the engine).
Sink = Callable[[bytes], bool]

# The body buffered past this while the client reads slowly stops reading from the engine
# (aiohttp's client paused at 128 KiB; a few SSE events or one JSON response fit either way).
# The relay holds the client's unsent bytes to the same mark (proxy/forward/relay.py).
HIGH_WATER = 256 * 1024


class Carrier(Protocol):
    """What a response calls on the connection that carries it (proxy/upstream/connection.py's
    `Connection`; a protocol, so that the two modules do not import each other)."""

    def taken(self) -> None:
        """The consumer took buffered body: reading from the engine may resume."""

    def abandon(self, response: UpstreamResponse) -> None:
        """The consumer gave `response` up before its end: the connection must close."""


class UpstreamResponse:
    """What the engine answered to one request, read by one consumer.

    The connection feeds it (head, body pieces, the end or an error); the consumer takes the
    body with `read()` until it returns b"". Its states are explicit: head pending → head
    ready → complete or failed; `close()` at any point gives up the rest and, unless the
    response was complete, closes the connection, which is what tells the engine to stop.
    """

    __slots__ = (
        "_buffered",
        "_chunks",
        "_complete",
        "_connection",
        "_error",
        "_sink",
        "_sink_behind",
        "_sink_error",
        "_waiter",
        "answer_read_ns",
        "body_read_ns",
        "head_arrived",
        "headers",
        "reason",
        "sent_ns",
        "status",
        "streamed_in_ns",
        "writer",
    )

    def __init__(self, connection: Carrier, head: asyncio.Future[None]) -> None:
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        # The task writing a body that is not in one buffer, while the response may already come.
        self.writer: asyncio.Task[None] | None = None
        self._connection: Carrier | None = connection
        self.head_arrived = head  # resolved when the head is in, failed when the response fails first
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        # While `relay()` runs, body pieces go to the sink as they arrive, not to the buffer.
        self._sink: Sink | None = None
        self._sink_behind = False
        self._sink_error: Exception | None = None
        # The marks of the sidecar's own time (proxy/observe/overhead.py; perf_counter_ns, 0 until
        # made): the request's last byte written to the engine; for a body streamed as the client
        # sends it, when its last piece was in hand; the read that completed the answer's head;
        # the first read that brought body bytes after it.
        self.sent_ns = 0
        self.streamed_in_ns = 0
        self.answer_read_ns = 0
        self.body_read_ns = 0

    # --- fed by the connection -------------------------------------------------------------

    def head_ready(self, status: int, reason: str, headers: CIMultiDict[str]) -> None:
        """The status line and headers are in."""
        self.status, self.reason, self.headers = status, reason, headers
        if not self.head_arrived.done():
            self.head_arrived.set_result(None)

    def body(self, data: bytes) -> bool:
        """A piece of the body; True when the buffer passed its high-water mark."""
        self._chunks.append(data)
        self._buffered += len(data)
        if self._sink is not None:
            return False  # relayed by `flush` at the end of this read
        self._wake()
        return self._buffered > HIGH_WATER

    def flush(self) -> bool:
        """The end of one read from the engine: while relaying, what it brought goes to the sink.

        In one piece: an engine's read often carries several SSE events, each its own chunk,
        and one write to the client for all of them costs what one write costs. True when
        the sink's reader is behind (stop reading from the engine).
        """
        sink = self._sink
        if sink is None or not self._chunks:
            return False
        try:
            behind = sink(self._take())
        except Exception as exc:
            self._sink, self._sink_error = None, exc
            self._wake()
            return True  # read no more: the consumer ends the response
        if behind:
            self._sink_behind = True
            self._wake()
        return behind

    def complete(self) -> None:
        """The whole response is in; the connection is no longer this response's."""
        self._complete = True
        self._connection = None
        self._wake()

    def fail(self, error: BaseException) -> None:
        """The response cannot be read to its end (the connection is gone or timed out)."""
        self._error = error
        self._connection = None
        if not self.head_arrived.done():
            self.head_arrived.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- read by the consumer --------------------------------------------------------------

    @property
    def content_type(self) -> str:
        """The media type without parameters, lower case (aiohttp's default when absent)."""
        value = self.headers.get("Content-Type")
        if value is None:
            return "application/octet-stream"
        return value.partition(";")[0].strip().lower()

    def _take(self) -> bytes:
        """The body buffered so far, in one piece, taken out of the buffer."""
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _fed(self) -> None:
        """Wait until the connection feeds the response: body, its end or its failure."""
        self._waiter = (
            self.head_arrived.get_loop().create_future()
        )  # no getpid(2), as get_running_loop() makes
        try:
            await self._waiter
        finally:
            self._waiter = None

    @property
    def in_hand(self) -> bool:
        """Whether `read()` would return at once: body buffered, or the end (or a failure) known."""
        return bool(self._chunks) or self._complete or self._error is not None

    async def read(self) -> bytes:
        """All the body buffered so far, waiting for some; b"" at the end.

        What arrived before a failure is returned first; the failure is raised after it.
        """
        while not self._chunks:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._fed()
        body = self._take()
        if self._connection is not None:
            self._connection.taken()
        return body

    async def relay(self, sink: Sink, drained: Callable[[], Awaitable[None]]) -> None:
        """Hand the body to `sink`, each piece as it arrives, until the end of the response.

        The pieces go from the connection's callback straight to the sink, what each read from
        the engine brought in one piece: no task wakes up per piece (issue 19: the SSE relay's
        per-event cost). What is buffered goes first.
        When the sink says its reader is behind, reading from the engine stops until
        `drained()` returns. Raises the response's failure, or what the sink raised.
        """
        self._sink = sink
        try:
            while True:
                if self._sink_error is not None:
                    raise self._sink_error
                if self._chunks:
                    # Buffered before the relay began, or in the read that ended the response (or
                    # failed it): the rest of the body, before the end or the failure.
                    self._sink_behind = sink(self._take()) or self._sink_behind
                if self._sink_behind:
                    await drained()
                    self._sink_behind = False
                    if self._connection is not None:
                        self._connection.taken()
                    continue
                if self._complete:
                    return
                if self._error is not None:
                    raise self._error
                await self._fed()
        finally:
            self._sink = None

    async def peek(self, limit: int) -> bytes:
        """The start of the body: read until `limit` bytes or the end, whichever comes first."""
        parts: list[bytes] = []
        size = 0
        while size < limit and (chunk := await self.read()):
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Give the response up: a response not read to its end closes its connection."""
        writer = self.writer
        if writer is not None and not writer.done():
            writer.cancel()
        if not self.head_arrived.done():
            self.head_arrived.cancel()
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.abandon(self)
