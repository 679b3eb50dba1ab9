"""One client connection while the front holds it: requests framed, served, or handed to aiohttp.

A connection starts with the front. Each request is read whole (its head, then the body its
Content-Length names, taken from max_buffered_bytes as it arrives) and served without
aiohttp's per-request machinery. The first request the front does not take — a head it
declines, a body that does not fit the budget now — goes to aiohttp with every byte from
its first on, and the connection stays aiohttp's: requests on one connection are answered
in order, by one server at a time.
"""

from __future__ import annotations

import asyncio
import logging
from enum import Enum
from typing import Protocol

from proxy.body_budget import Reading
from proxy.front.answer import ClientWriter
from proxy.front.head import MAX_HEAD_BYTES, RequestHead, head_end, parse_head
from proxy.front.serve import Front, FrontSide
from proxy.logs import log_event

__all__ = ["FrontConnection", "Host"]

log = logging.getLogger("cachewitness.front")

# Bytes of later requests kept while one is served (a pipelining client); past this the
# transport stops reading until the answer is out.
_PIPELINE_BYTES = 256 * 1024


class Host(Protocol):
    """What the front tells the connection that holds it (proxy/connections/client.py)."""

    def hand_off(self, pieces: tuple[bytes | bytearray, ...]) -> None:
        """aiohttp takes the connection, the bytes of `pieces` first (in pieces: a body is not joined)."""

    def body_arriving(self) -> None:
        """A head is in and its body is on its way: body_idle_timeout runs."""

    def serving(self) -> None:
        """A request is all in and served (it is in progress from `body_arriving` until `served`)."""

    def served(self) -> None:
        """Its answer is out: keep-alive idle until the next request's first byte."""

    def head_started(self) -> None:
        """A head's first bytes are in hand: header_timeout runs."""


class _State(Enum):
    HEAD = "head"  # bytes of a head (or none yet)
    BODY = "body"  # a head the front takes; its body arriving
    SERVING = "serving"
    GONE = "gone"  # handed to aiohttp, or closed


class FrontConnection:
    """The front's half of one client connection (its transport's protocol is the guard's ClientConnection)."""

    # One per open connection: slots keep 1,000 open streams' worth small.
    __slots__ = (
        "_body",
        "_buffer",
        "_front",
        "_head",
        "_head_bytes",
        "_host",
        "_loop",
        "_paused_reading",
        "_reading",
        "_side",
        "_state",
        "_task",
        "_task_begun",
        "_transport",
        "_writer",
    )

    def __init__(self, front: Front, host: Host, transport: asyncio.Transport) -> None:
        self._front = front
        self._host = host
        self._transport = transport
        self._buffer = bytearray()  # bytes not yet framed: a head, or what came after a body
        self._body = bytearray()  # the body of the head the front took, as it arrives
        self._state = _State.HEAD
        self._head: RequestHead | None = None
        self._head_bytes = b""  # the taken head as it came, for aiohttp should the body not fit
        self._reading: Reading | None = None
        self._task: asyncio.Task[None] | None = None
        self._task_begun = False  # its coroutine has started (a cancel then reaches its `finally`)
        self._side: FrontSide | None = None
        self._paused_reading = False
        # Once per connection: asyncio.get_running_loop() makes a getpid(2) each call (Python 3.11).
        self._loop = asyncio.get_running_loop()
        self._writer = ClientWriter(transport, self._loop)

    # --- from the transport, through the host --------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._state is _State.BODY:
            rest = self._take_body(data)  # what is left: a later request's bytes (none if handed off)
            if not rest:
                return
            data = bytes(rest)  # a slice of `data`, bytes already (no copy)
        if self._state is _State.HEAD and not self._buffer:
            # The usual read: a request's first bytes, framed where they lie. Its body (a 220 KB
            # prompt arrives in one or two reads) is then copied once, into the body buffer.
            self._frame(data)
            return
        self._buffer += data
        if self._state is _State.SERVING:
            if len(self._buffer) > _PIPELINE_BYTES and not self._paused_reading:
                self._paused_reading = True
                self._transport.pause_reading()
            return
        self._advance()

    def connection_lost(self, exc: Exception | None) -> None:
        """The client is gone: a request being served is cancelled (its upstream closed); budget given back."""
        reading_body = self._state is _State.BODY
        self._state = _State.GONE
        self._writer.resume()
        self._give_back()
        if reading_body:
            self._host.served()  # a request that was never served is over too
        if self._task is not None and self._task_begun and not self._task.done():
            self._task.cancel()  # it is over when the task is (_serving's end)
        # A task not yet begun is not cancelled: a cancel would end it before its first line, and
        # with it the bookkeeping at its end. It begins, finds the client gone, and ends there.

    def pause_writing(self) -> None:
        self._writer.pause()

    def resume_writing(self) -> None:
        self._writer.resume()

    def stalled(self) -> None:
        """client_write_timeout cut this client: the request served gets outcome client_stalled."""
        if self._side is not None:
            self._side.stalled = True

    # --- framing --------------------------------------------------------------------------

    def _advance(self) -> None:
        """Frame what is buffered."""
        buffered, self._buffer = self._buffer, bytearray()
        self._frame(buffered)

    def _frame(self, data: bytes | bytearray) -> None:
        """Frame `data`, all there is unframed: a complete head is taken or declined; a taken
        head's body is read; the start of a head is kept for the next read."""
        end = head_end(data, 0)
        if end < 0:
            self._buffer = data if isinstance(data, bytearray) else bytearray(data)
            if len(self._buffer) > MAX_HEAD_BYTES:
                self._hand_off()
            return
        raw = bytes(data[:end])
        head = parse_head(raw)
        if head is None or not self._front.takes(head):
            self._hand_off(data)
            return
        self._head, self._head_bytes, self._state = head, raw, _State.BODY
        self._reading = self._front.budget.start_reading()
        self._host.body_arriving()
        with memoryview(data) as view:  # the body's bytes are sliced, not copied, until they join it
            rest = self._take_body(view[end:])
            self._buffer += rest  # a later request's bytes stay for after this one

    def _take_body(self, data: bytes | memoryview) -> bytes | memoryview:
        """Add what arrived of the body, within the budget; what is past it (a later request's bytes) is returned.

        The whole body in: it is served. The budget short: the request goes to aiohttp, head
        and body as they came, which reads it within the budget its own way (or streams it
        unobserved).
        """
        head, reading = self._head, self._reading
        assert head is not None and reading is not None
        need = head.content_length - len(self._body)
        piece, rest = (data, b"") if len(data) <= need else (data[:need], data[need:])
        if piece and not self._front.budget.take_now(reading, len(piece)):
            body, self._body = self._body, bytearray()
            self._hand_off(self._head_bytes, body, bytes(piece), bytes(rest))
            return b""
        self._body += piece
        if len(self._body) < head.content_length:
            return b""
        body, self._body = self._body, bytearray()
        self._front.budget.done_reading(reading, complete=True)
        self._serve(head, body, reading)
        return rest

    def _serve(self, head: RequestHead, body: bytearray, reading: Reading) -> None:
        self._state = _State.SERVING
        self._reading = None  # the exchange gives it back
        self._host.serving()
        side = self._side = FrontSide(self._front, self._writer, head)
        self._task_begun = False
        self._task = self._loop.create_task(self._serving(side, body, reading))

    async def _serving(self, side: FrontSide, body: bytearray, reading: Reading) -> None:
        """Serve one request, then take the next (or close the connection).

        What follows the answer runs here, at the coroutine's end, rather than in a done
        callback: a task's done callbacks run one loop iteration later, an epoll_wait(2) and a
        turn of the loop more for every request (issue 34).
        """
        self._task_begun = True
        try:
            await self._front.serve(side, body, reading)
        except Exception as error:  # serve() answers its own failures; this is a bug past that
            log_event(log, logging.ERROR, "front: serving a request failed", error=repr(error))
            self._transport.abort()
        finally:
            self._finished()

    def _finished(self) -> None:
        """The answer is out: the next request, or the end of the connection."""
        self._task, self._side = None, None
        self._host.served()  # the request is over, whether or not its client stayed
        if self._state is _State.GONE:
            return
        head = self._head
        self._head, self._head_bytes = None, b""
        front = self._front
        if (
            head is None
            or not head.keep_alive
            or not front.keeps_alive
            or front.closing
            or self._transport.is_closing()
        ):
            self._state = _State.GONE
            self._transport.close()
            return
        self._state = _State.HEAD
        if self._paused_reading:
            self._paused_reading = False
            self._transport.resume_reading()
        if self._buffer:
            self._host.head_started()  # a later request's bytes came while this one was served
            self._advance()

    def _hand_off(self, *pieces: bytes | bytearray) -> None:
        """aiohttp takes the connection from this request's first byte on: `pieces` (else what is buffered), in order."""
        self._give_back()
        self._state = _State.GONE
        if not pieces:
            pieces, self._buffer = (self._buffer,), bytearray()
        if self._paused_reading:
            self._paused_reading = False
            self._transport.resume_reading()
        self._host.hand_off(pieces)

    def _give_back(self) -> None:
        """A body being read that will not be served here: its budget back."""
        reading, self._reading = self._reading, None
        if reading is not None:
            self._front.budget.done_reading(reading, complete=True)
            self._front.budget.give_back(reading)
