"""Writing a request body to the engine that is not one buffer: large pieces in slices, or the
client's stream as it comes, waiting for the connection to drain between writes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from time import perf_counter_ns
from typing import Protocol

from proxy.upstream.head import Body, chunk_pieces

__all__ = ["WriteMarks", "write_body"]

# Pieces of a large body are written 64 KiB at a time, draining between them.
_SLICE = 64 * 1024


class WriteMarks(Protocol):
    """Where a body's writing leaves its clock marks (perf_counter_ns; the engine's response holds them)."""

    sent_ns: int  # the last byte written
    streamed_in_ns: int  # a streamed body's last piece in hand


async def write_body(
    transport: asyncio.Transport,
    body: Body,
    chunked: bool,
    drained: Callable[[], Awaitable[None]],
    marks: WriteMarks,
) -> None:
    """Write `body` (pieces, or an async stream of chunks; framed when `chunked`), awaiting
    `drained` after each write (it raises when the connection is gone).

    `marks` gets when the last byte was written (before the wait for the engine to read it: that
    is the engine's time), and for a stream when its last piece was in hand.
    """
    if isinstance(body, tuple):
        for piece in body:
            view = memoryview(piece)
            for offset in range(0, len(view), _SLICE):
                transport.write(view[offset : offset + _SLICE])
                marks.sent_ns = perf_counter_ns()
                await drained()
        return
    assert isinstance(body, AsyncIterator)
    async for chunk in body:
        if not chunk:
            continue  # an empty chunk would end a chunked body
        marks.streamed_in_ns = perf_counter_ns()
        if chunked:
            transport.writelines(chunk_pieces(chunk))  # the first chunk may be all the body read so far
        else:
            transport.write(chunk)
        marks.sent_ns = perf_counter_ns()
        await drained()
    if chunked:
        marks.streamed_in_ns = perf_counter_ns()  # the client's own end of the body was read just now
        transport.write(b"0\r\n\r\n")
        marks.sent_ns = perf_counter_ns()
