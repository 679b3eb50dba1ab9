"""One client connection: one asyncio protocol, the front's framing or aiohttp's request handler, one deadline.

A connection starts with the front (with `front = true`, on a connection let in under
max_connections). Each request is framed here (proxy/inbound/framing.py: its head, then the
body its Content-Length names, taken from max_buffered_bytes as it arrives) and, when the front
takes it (proxy/inbound/choice.py), served without aiohttp's per-request machinery
(proxy/inbound/front.py). The first request it does not take goes to aiohttp's request handler
with every byte from its first on, and the connection is aiohttp's from then on: requests on
one connection are answered in order, by one server at a time.

The deadline (the guard's limits, proxy/inbound/guard.py) moves with the timestamps the events
leave behind (the way aiohttp's own keep-alive timer works), so data arriving costs a clock
read, not a timer per chunk.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from time import perf_counter_ns
from typing import cast

from aiohttp import web

from proxy.body_budget import Reading
from proxy.inbound.choice import BUDGET_SHORT, FRONT_OFF, HEAD_TOO_LARGE, PROBE_SLOT, Choice, choose
from proxy.inbound.deadline import Deadlines, Guard
from proxy.inbound.framing import BODY_REFUSED, NEED_DATA, Framer, Head, Request
from proxy.inbound.front import ClientWriter, Front, FrontSide
from proxy.inbound.head import RequestHead, parse_head
from proxy.inbound.limits import CLIENT_STALLED, PEER_REFUSAL, REFUSAL, Limit, Phase, unsent
from proxy.logs import log_event
from proxy.vocabulary import ServedBy

__all__ = ["CLIENT_STALLED", "ClientConnection", "Guard", "read_mark"]

log = logging.getLogger("cachewitness.front")

# Bytes of later requests kept while one is served (a pipelining client); past this the
# transport stops reading until the response is out.
_PIPELINE_BYTES = 256 * 1024


def _chose(choice: Choice) -> None:
    """Who serves a request and why, at debug level (a check, not a log line, when that is off)."""
    if log.isEnabledFor(logging.DEBUG):
        log_event(log, logging.DEBUG, f"request served by {choice.served_by}", **choice._asdict())


def read_mark(request: web.BaseRequest) -> int:
    """When the request's connection last brought bytes in (perf_counter_ns): once its body is
    read, its last byte. Now, on a connection the guard does not hold (a test's own server)."""
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol.read_ns if isinstance(protocol, ClientConnection) else perf_counter_ns()


class ClientConnection(Deadlines, asyncio.Protocol):
    """One client connection: the front while it holds it, then aiohttp's request handler; one deadline."""

    def __init__(self, guard: Guard, server: web.Server) -> None:
        self._guard = guard
        self._server = server
        self._handler: asyncio.Protocol | None = None  # aiohttp's, once the connection is aiohttp's
        self._transport: asyncio.Transport | None = None
        # Once per connection: asyncio.get_running_loop() makes a getpid(2) each call (Python 3.11).
        self._loop = asyncio.get_running_loop()
        self._phase = Phase.HEAD
        self._head_since = self._loop.time()
        self._last_data = self._head_since
        self._body_since = self._head_since
        self._idle_since = self._head_since
        self.peer = ""  # the client's address (max_connections_per_peer counts by it)
        # When the client's bytes last came in (perf_counter_ns): a request's last byte once it
        # is all read, where the sidecar's added time starts (proxy/observe/overhead.py).
        self.read_ns = 0
        self._request: web.BaseRequest | None = None  # aiohttp's request in progress
        self._lost = False  # connection_lost ran: no deadline is armed any more
        self._due: float | None = None  # when the phase's limit is next checked (None: no limit runs)
        self.probe_only = False  # let in past max_connections, for one probe request
        # While writing is paused (the client is behind): when to look again, the write buffer's
        # size at the last look, and when the client last took bytes.
        self._write_due: float | None = None
        self._write_mark = 0
        self._write_progress = 0.0
        # The front's, while it holds the connection (until it hands it to aiohttp).
        self._front: Front | None = None
        self._framer = Framer()
        self._writer: ClientWriter | None = None
        self._head: RequestHead | None = None  # the head taken, while its body arrives and it is served
        self._reading: Reading | None = None  # its body's hold on max_buffered_bytes, while it arrives
        self._task: asyncio.Task[None] | None = None  # serving it
        self._task_begun = False  # its coroutine has started (a cancel then reaches its `finally`)
        self._side: FrontSide | None = None
        self._paused_reading = False

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Refuse past max_connections; else start with the front (or aiohttp) and the head clock."""
        transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses
        guard = self._guard
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else ""
        if guard.peer_full(self.peer):
            guard.hit(Limit.MAX_CONNECTIONS_PER_PEER)
            transport.write(PEER_REFUSAL)
            transport.close()
            return
        if guard.max_connections and guard.open_connections >= guard.max_connections:
            self.probe_only = True
        if self.probe_only and guard.open_connections >= guard.max_connections + guard.probe_slots:
            guard.hit(Limit.MAX_CONNECTIONS)
            # Closed at once, not lingered: under a flood the descriptor is what must be freed. A
            # client whose request was already sent may then see a reset instead of the 503.
            transport.write(REFUSAL)
            transport.close()
            return
        self._transport = transport
        guard.opened(transport, self)
        if guard.front is not None and not self.probe_only:
            self._front, self._writer = guard.front, ClientWriter(transport, self._loop)
        else:
            _chose(PROBE_SLOT if self.probe_only else FRONT_OFF)
            self._handler = self._server()
            self._handler.connection_made(transport)
        self._arm(self._head_since + guard.header_timeout if guard.header_timeout else None)

    def data_received(self, data: bytes) -> None:
        """Note the time; the first byte after an idle keep-alive starts the next head's clock."""
        if self._handler is None and self._front is None:
            return  # a refused connection (or one the front closed): its bytes are discarded
        self.read_ns = perf_counter_ns()
        now = self._loop.time()
        self._last_data = now
        if self._phase is Phase.IDLE:
            self._start_head(now)
        if self._front is not None:
            try:
                self._front_data(data)
            except Exception as error:  # a bug of ours a client's bytes found: never the loop's to log
                self._guard.fault(error)
                self._front_transport().abort()
        elif self._handler is not None:
            self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        """aiohttp decides what a half-close means; to the front (as to aiohttp) it is the end."""
        return self._handler.eof_received() if self._handler is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection: aiohttp's handler is told (it cancels its handler), the front's
        request cancelled (its upstream closed) and its budget given back."""
        self._lost = True
        self._disarm()
        self._write_due = None
        if self._transport is None:
            return  # refused: never let in
        self._guard.closed(self._transport)
        if self._handler is not None:
            self._handler.connection_lost(exc)
            return
        reading_body = self._reading is not None
        if self._writer is not None:
            self._writer.resume()
        self._give_back()
        if reading_body:
            self._served()  # a request that was never served is over too
        if self._task is not None and self._task_begun and not self._task.done():
            self._task.cancel()  # it is over when the task is (_serving's end)
        # A task not yet begun is not cancelled: a cancel would end it before its first line, and
        # with it the bookkeeping at its end. It begins, finds the client gone, and ends there.

    def pause_writing(self) -> None:
        """The client is behind: client_write_timeout starts running; flow control is the server's."""
        timeout = self._guard.client_write_timeout
        if timeout and self._transport is not None:
            self._write_progress = self._loop.time()
            self._write_mark = unsent(self._transport)
            self._write_due = self._write_progress + timeout / 4
            self._guard.watchdog.watch(self)
        if self._handler is not None:
            self._handler.pause_writing()
        elif self._writer is not None:
            self._writer.pause()

    def resume_writing(self) -> None:
        """The client caught up."""
        self._write_due = None
        if self._handler is not None:
            self._handler.resume_writing()
        elif self._writer is not None:
            self._writer.resume()

    @property
    def phase(self) -> Phase:
        """Where the connection is in its request cycle."""
        return self._phase

    # --- aiohttp's request cycle, from the guard's `guarded` ------------------------------

    def request_started(self, request: web.BaseRequest) -> None:
        """The head is complete: header_timeout stops; body_idle_timeout runs while the body is unread."""
        self._phase = Phase.REQUEST
        self._request = request
        self._last_data = self._body_since = self._loop.time()
        self._arm(self._body_due() if not request.content.is_eof() else None)

    def request_finished(self) -> None:
        """Back to keep-alive idle: the next request's first byte starts its head clock."""
        self._request = None
        self._phase = Phase.IDLE
        self._disarm()

    # --- the front: framing, serving, handing off ------------------------------------------

    def _front_data(self, data: bytes) -> None:
        """Bytes for the front: framed now, or kept while a request is served (pipelined)."""
        self._framer.feed(data)
        if self._task is None:
            self._frame()
        elif self._framer.buffered > _PIPELINE_BYTES and not self._paused_reading:
            self._paused_reading = True
            self._front_transport().pause_reading()

    def _frame(self) -> None:
        """Frame what the client sent: take a head or hand the connection off; read a taken head's body."""
        front, framer = self._front, self._framer
        assert front is not None
        while True:
            event = framer.next_event()
            if event is NEED_DATA:
                return
            if isinstance(event, Request):
                self._serve(event.body)
                return
            if isinstance(event, Head):
                head = parse_head(event.raw)
                choice = choose(head, front)
                if log.isEnabledFor(logging.DEBUG):
                    _chose(choice)
                if head is None or head.content_length is None or choice.served_by is not ServedBy.FRONT:
                    self._hand_off(choice)
                    return
                reading = self._reading = front.budget.start_reading()
                self._head = head
                framer.take(head.content_length, partial(front.budget.take_now, reading))
                self._body_arriving(whole=framer.buffered >= head.content_length)
                continue
            # BODY_REFUSED: aiohttp reads it within the budget its own way; HEAD_TOO_LARGE: aiohttp's to refuse
            choice = BUDGET_SHORT if event is BODY_REFUSED else HEAD_TOO_LARGE
            _chose(choice)
            self._hand_off(choice)
            return

    def _body_arriving(self, *, whole: bool) -> None:
        """A head is taken: the request is in progress (as aiohttp's is once its head is in);
        body_idle_timeout runs while its body arrives. A body `whole` in the read that brought
        its head is served before the loop turns again: no deadline of its own (issue 50)."""
        self._guard.request_begun()
        self._phase = Phase.REQUEST
        self._last_data = self._body_since = self._loop.time()
        if not whole:
            self._arm(self._body_due())

    def _serve(self, body: bytearray) -> None:
        """The whole request is in: served, however long the engine takes (no deadline runs)."""
        front, head, reading, writer = self._front, self._head, self._reading, self._writer
        assert front is not None and head is not None and reading is not None and writer is not None
        front.budget.done_reading(reading, complete=True)
        self._reading = None  # the exchange gives it back
        self._phase = Phase.REQUEST
        self._disarm()
        side = self._side = FrontSide(front, writer, head)
        self._task_begun = False
        self._task = self._loop.create_task(self._serving(front, side, body, reading))

    async def _serving(self, front: Front, side: FrontSide, body: bytearray, reading: Reading) -> None:
        """Serve one request, then take the next (or close the connection).

        What follows the response runs here, at the coroutine's end, rather than in a done
        callback: a task's done callbacks run one loop iteration later, an epoll_wait(2) and a
        turn of the loop more for every request (issue 34).
        """
        self._task_begun = True
        try:
            await front.serve(side, body, reading)
        except Exception as error:  # serve() answers its own failures; this is a bug past that
            log_event(log, logging.ERROR, "front: serving a request failed", error=repr(error))
            self._front_transport().abort()
        finally:
            self._finished(front)

    def _finished(self, front: Front) -> None:
        """The response is out: keep-alive idle, then the next request (or the end of the connection)."""
        self._task, self._side = None, None
        self._served()  # the request is over, whether or not its client stayed
        head, self._head = self._head, None
        if self._lost:
            return
        transport = self._front_transport()
        if (
            head is None
            or not head.keep_alive
            or not front.keeps_alive
            or front.shutdown.closing
            or transport.is_closing()
        ):
            self._front = None
            transport.close()
            return
        if self._paused_reading:
            self._paused_reading = False
            transport.resume_reading()
        if self._framer.buffered:
            self._start_head(self._loop.time())  # a later request's bytes came while this one was served
            self._frame()

    def _served(self) -> None:
        """The front's request is over (answered, or its client gone): keep-alive idle, closed after keepalive_timeout."""
        self._guard.request_done()
        self._phase = Phase.IDLE
        self._idle_since = self._loop.time()
        keepalive = self._guard.keepalive_timeout
        self._arm(self._idle_since + keepalive if keepalive else None)

    def _hand_off(self, choice: Choice) -> None:
        """aiohttp takes the connection for good, from the first byte of the request the front declined."""
        if self._reading is not None:
            self._guard.request_done()  # aiohttp counts it again, as its own
        self._give_back()
        self._front, pieces = None, self._framer.decline()
        transport = self._front_transport()
        if self._paused_reading:
            self._paused_reading = False
            transport.resume_reading()
        if transport.is_closing():
            return
        self._phase = Phase.HEAD
        if self._guard.header_timeout:
            self._arm(self._head_since + self._guard.header_timeout)
        self._handler = self._server()
        self._handler.connection_made(transport)
        for piece in pieces:
            self._handler.data_received(bytes(piece) if isinstance(piece, bytearray) else piece)

    def _give_back(self) -> None:
        """A body being read that will not be served here: its budget back."""
        reading, self._reading = self._reading, None
        if reading is not None and self._front is not None:
            self._front.budget.done_reading(reading, complete=True)
            self._front.budget.give_back(reading)

    def _front_transport(self) -> asyncio.Transport:
        assert self._transport is not None, "the front holds only connections let in"
        return self._transport

    # --- what the deadline asks of the connection ---------------------------------------

    def _body_unread(self) -> bool:
        """Whether the request in progress still has body bytes to come (aiohttp's, or the front's)."""
        if self._request is not None:
            return not self._request.content.is_eof()
        return self._reading is not None

    def _stalled(self) -> None:
        """client_write_timeout cut this client: its request's outcome is client_stalled."""
        if self._request is not None:
            self._request[CLIENT_STALLED] = True
        elif self._side is not None:
            self._side.stalled = True

    def _front_holds(self) -> bool:
        """Whether the front holds the connection (its idle keep-alive limit is then ours to keep)."""
        return self._front is not None
