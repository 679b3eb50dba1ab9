"""One client connection as the guard sees it: aiohttp's request handler behind a protocol
that knows the connection's phase and its one deadline (proxy/connections/guard.py has the limits)."""

from __future__ import annotations

import asyncio
import fcntl
import sys
import termios
from collections.abc import Callable
from enum import StrEnum
from time import perf_counter_ns
from typing import Protocol, cast

from aiohttp import web

from proxy.connections.answers import HEAD_TIMEOUT_ANSWER, PEER_REFUSAL, REFUSAL, REFUSAL_BODY
from proxy.watchdog import Watchdog

__all__ = ["CLIENT_STALLED", "REFUSAL_BODY", "ClientConnection", "Guard", "Limit", "Phase", "read_mark"]

# SIOCOUTQ (Linux's TIOCOUTQ on a socket): bytes in the send queue the peer has not acknowledged.
_OUTQ: int | None = getattr(termios, "TIOCOUTQ", None) if sys.platform == "linux" else None


# Set on a request whose client was cut by client_write_timeout.
CLIENT_STALLED = web.RequestKey("client_stalled", bool)


class Limit(StrEnum):
    """The connection limits, as metric labels and log words."""

    HEADER_TIMEOUT = "header_timeout"
    BODY_IDLE_TIMEOUT = "body_idle_timeout"
    BODY_TIMEOUT = "body_timeout"
    CLIENT_WRITE_TIMEOUT = "client_write_timeout"
    MAX_CONNECTIONS = "max_connections"
    MAX_CONNECTIONS_PER_PEER = "max_connections_per_peer"


class Phase(StrEnum):
    """Where a connection is in its request cycle."""

    HEAD = "head"  # waiting for (the rest of) a request head: header_timeout runs
    REQUEST = "request"  # a handler runs: body_idle_timeout runs while the body is unread
    IDLE = "idle"  # keep-alive between requests: aiohttp's keepalive_timeout applies (serve.py sets it)


class FrontPart(Protocol):
    """The front's half of a connection it holds (proxy/front/connection.py)."""

    def data_received(self, data: bytes) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...

    def stalled(self) -> None: ...


# Makes the front's half of a new connection: (the connection, its transport) → FrontPart.
FrontFactory = Callable[["ClientConnection", asyncio.Transport], FrontPart]


class Guard(Protocol):
    """What a connection reads and tells of the guard that let it in (ConnectionGuard)."""

    header_timeout: float
    body_idle_timeout: float
    body_timeout: float
    client_write_timeout: float
    keepalive_timeout: float
    max_connections: int
    probe_slots: int
    open_connections: int
    watchdog: Watchdog[ClientConnection]
    front: FrontFactory | None

    def peer_full(self, peer: str) -> bool:
        """Whether `peer` has max_connections_per_peer connections open already."""

    def request_begun(self) -> None:
        """A request's handler (or the front's exchange) starts."""

    def request_done(self) -> None:
        """It is over."""

    def hit(self, limit: Limit) -> None:
        """Count (and log) one hit of a limit."""

    def fault(self, error: Exception) -> None:
        """Log (throttled) an exception a client's bytes raised in the front: its connection is cut."""

    def opened(self, transport: asyncio.BaseTransport, connection: ClientConnection) -> None:
        """A connection was let in."""

    def closed(self, transport: asyncio.BaseTransport) -> None:
        """A connection that was let in is gone."""


def read_mark(request: web.BaseRequest) -> int:
    """When the request's connection last brought bytes in (perf_counter_ns): once its body is
    read, its last byte. Now, on a connection the guard does not hold (a test's own server)."""
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol.read_ns if isinstance(protocol, ClientConnection) else perf_counter_ns()


def _unsent(transport: asyncio.Transport) -> int:
    """Bytes written to the client that it has not taken: the transport's buffer and the kernel's send queue.

    The transport's buffer alone moves in steps of half the kernel's send buffer (a few MiB on
    Linux): a client that reads 10 KiB/s would seem to take nothing for minutes.
    """
    size = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if _OUTQ is not None and sock is not None:
        try:
            queued = fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0")
        except OSError:
            return size
        size += int.from_bytes(queued, sys.byteorder, signed=True)
    return size


class ClientConnection(asyncio.Protocol):
    """One client connection: aiohttp's request handler, with one deadline the guard's watchdog checks.

    The deadline moves with the timestamps the events leave behind (the way aiohttp's own
    keep-alive timer works), so data arriving costs a clock read, not a timer per chunk.
    """

    def __init__(self, guard: Guard, server: web.Server) -> None:
        self._guard = guard
        self._server = server
        self._handler: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._phase = Phase.HEAD
        self._head_since = self._loop.time()
        self._last_data = self._head_since
        self._request: web.BaseRequest | None = None
        self._front: FrontPart | None = None  # the front holds the connection (until it hands it off)
        self._front_body = False  # the front is reading a request body: body_idle_timeout runs
        # When the request body began to arrive, moved on by the time the sidecar paused reading:
        # body_timeout counts the client's time only.
        self._body_since = self._head_since
        self.peer = ""  # the client's address (max_connections_per_peer counts by it)
        # When the client's bytes last came in (perf_counter_ns): a request's last byte once it
        # is all read, where the sidecar's added time starts (proxy/observe/overhead.py).
        self.read_ns = 0
        self._idle_since = self._head_since
        self._lost = False  # connection_lost ran: no deadline is armed any more
        self._due: float | None = None  # when the phase's limit is next checked (None: no limit runs)
        self.probe_only = False  # let in past max_connections, for one probe request
        # While writing is paused (the client is behind): when to look again, the write buffer's
        # size at the last look, and when the client last took bytes.
        self._write_due: float | None = None
        self._write_mark = 0
        self._write_progress = 0.0

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Refuse past max_connections; else hand the connection to aiohttp and start the head clock."""
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
            self._front = guard.front(self, transport)
        else:
            self._handler = self._server()
            self._handler.connection_made(transport)
        self._arm(self._head_since + guard.header_timeout if guard.header_timeout else None)

    def data_received(self, data: bytes) -> None:
        """Note the time; the first byte after an idle keep-alive starts the next head's clock."""
        if self._handler is None and self._front is None:
            return  # a refused connection: its bytes are discarded
        self.read_ns = perf_counter_ns()
        now = self._loop.time()
        self._last_data = now
        if self._phase is Phase.IDLE:
            self._start_head(now)
        if self._front is not None:
            try:
                self._front.data_received(data)
            except Exception as error:  # a bug of ours a client's bytes found: never the loop's to log
                self._guard.fault(error)
                if self._transport is not None:
                    self._transport.abort()
        elif self._handler is not None:
            self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        """aiohttp decides what a half-close means; to the front (as to aiohttp) it is the end."""
        return self._handler.eof_received() if self._handler is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection and tell aiohttp (which cancels a running handler)."""
        self._lost = True
        self._disarm()
        self._write_due = None
        if self._handler is None and self._front is None:
            return
        if self._transport is not None:
            self._guard.closed(self._transport)
        if self._front is not None:
            self._front.connection_lost(exc)
        elif self._handler is not None:
            self._handler.connection_lost(exc)

    def pause_writing(self) -> None:
        """Flow control is aiohttp's; client_write_timeout starts running."""
        timeout = self._guard.client_write_timeout
        if timeout and self._transport is not None:
            self._write_progress = self._loop.time()
            self._write_mark = _unsent(self._transport)
            self._write_due = self._write_progress + timeout / 4
            self._guard.watchdog.watch(self)
        if self._front is not None:
            self._front.pause_writing()
        elif self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        """Flow control is aiohttp's; the client caught up."""
        self._write_due = None
        if self._front is not None:
            self._front.resume_writing()
        elif self._handler is not None:
            self._handler.resume_writing()

    @property
    def phase(self) -> Phase:
        """Where the connection is in its request cycle."""
        return self._phase

    # --- the request cycle, from the guard's `guarded` ------------------------------------

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

    # --- the front's cycle (proxy/front/connection.py): it frames requests, so it says where it is

    def hand_off(self, pieces: tuple[bytes | bytearray, ...]) -> None:
        """aiohttp takes the connection for good, from the first byte of the request the front declined."""
        transport = self._transport
        if self._front_body:
            self._guard.request_done()  # aiohttp counts it again, as its own
        self._front, self._front_body = None, False
        if transport is None or transport.is_closing():
            return
        self._phase = Phase.HEAD
        if self._guard.header_timeout:
            self._arm(self._head_since + self._guard.header_timeout)
        self._handler = self._server()
        self._handler.connection_made(transport)
        for piece in pieces:
            if piece:
                self._handler.data_received(bytes(piece) if isinstance(piece, bytearray) else piece)

    def body_arriving(self) -> None:
        """The front took a head: the request is in progress (as aiohttp's is once its head is in);
        body_idle_timeout runs while its body arrives."""
        self._guard.request_begun()
        self._phase = Phase.REQUEST
        self._front_body = True
        self._last_data = self._body_since = self._loop.time()
        self._arm(self._body_due())

    def serving(self) -> None:
        """The front has the whole request and serves it: the answer may take as long as the engine needs."""
        self._phase = Phase.REQUEST
        self._front_body = False
        self._disarm()

    def head_started(self) -> None:
        """Bytes of the next request came while the front served one: its head clock starts now."""
        self._start_head(self._loop.time())

    def _start_head(self, now: float) -> None:
        """A request head begins: header_timeout runs from `now`."""
        self._phase = Phase.HEAD
        self._head_since = now
        if self._guard.header_timeout:
            self._arm(now + self._guard.header_timeout)

    def served(self) -> None:
        """The front's request is over (answered, or its client gone): keep-alive idle, closed after keepalive_timeout."""
        self._guard.request_done()
        self._front_body = False
        self._phase = Phase.IDLE
        self._idle_since = self._loop.time()
        keepalive = self._guard.keepalive_timeout
        self._arm(self._idle_since + keepalive if keepalive else None)

    # --- the deadline -----------------------------------------------------------------------

    def _arm(self, when: float | None) -> None:
        # A connection gone is never watched again: the front's exchange may end after the loss
        # (its cancelled task), and a deadline armed then would hold the connection for up to
        # keepalive_timeout (the soak saw its RSS grow by ~600 bytes a request).
        if self._lost:
            return
        self._due = when
        if when is not None:
            self._guard.watchdog.watch(self)

    def _disarm(self) -> None:
        self._due = None

    def check_deadline(self, now: float) -> bool:
        """The watchdog's look: check the limits whose deadline passed; whether one still runs."""
        if self._due is not None and now >= self._due:
            self._due = None
            self._check()
        if self._write_due is not None and now >= self._write_due:
            self._write_due = None
            self._check_write(now)
        return self._due is not None or self._write_due is not None

    def _check_write(self, now: float) -> None:
        """Writing is paused: cut the client if it took no byte for client_write_timeout, else look again.

        Looked at four times per timeout: the unsent bytes shrink only as the client takes them.
        """
        transport, guard = self._transport, self._guard
        if transport is None or transport.is_closing():
            return
        size = _unsent(transport)
        if size < self._write_mark:
            self._write_progress = now
        self._write_mark = size  # it may also grow: what was written after writing paused
        if now - self._write_progress < guard.client_write_timeout:
            self._write_due = now + guard.client_write_timeout / 4
            return
        guard.hit(Limit.CLIENT_WRITE_TIMEOUT)
        if self._request is not None:
            self._request[CLIENT_STALLED] = True
        elif self._front is not None:
            self._front.stalled()
        transport.abort()  # nothing more can reach this client; connection_lost cancels the handler

    def _body_due(self) -> float | None:
        """When the body's limits are next due: its silence (body_idle_timeout) or its whole time (body_timeout)."""
        guard = self._guard
        dues = []
        if guard.body_idle_timeout:
            dues.append(self._last_data + guard.body_idle_timeout)
        if guard.body_timeout:
            dues.append(self._body_since + guard.body_timeout)
        return min(dues) if dues else None

    @property
    def receiving_body(self) -> bool:
        """Whether a request's body is arriving on this connection now."""
        return self._phase is Phase.REQUEST and not self._lost and self._body_unread()

    def _body_unread(self) -> bool:
        """Whether the request in progress still has body bytes to come (aiohttp's, or the front's)."""
        if self._request is not None:
            return not self._request.content.is_eof()
        return self._front is not None and self._front_body

    def _check(self) -> None:
        """The deadline passed: close the connection if its phase's limit has passed, else re-arm."""
        transport, guard, now = self._transport, self._guard, self._loop.time()
        if transport is None or transport.is_closing():
            return
        if self._phase is Phase.HEAD:
            if now - self._head_since >= guard.header_timeout:
                guard.hit(Limit.HEADER_TIMEOUT)
                transport.write(HEAD_TIMEOUT_ANSWER)
                transport.close()
            else:
                self._arm(self._head_since + guard.header_timeout)
            return
        if self._phase is Phase.IDLE:
            # Only the front's idle connections have this deadline (aiohttp keeps its own).
            if self._front is not None:
                if now - self._idle_since >= guard.keepalive_timeout:
                    transport.close()
                else:
                    self._arm(self._idle_since + guard.keepalive_timeout)
            return
        if not self._body_unread():
            return  # the body is all in: the response may take as long as the engine needs
        if not transport.is_reading():
            # Paused by aiohttp's flow control: the sidecar is the slow side, not the client; the
            # time since the client was last heard does not count against it either.
            self._body_since += now - self._last_data
            self._last_data = now
        elif guard.body_idle_timeout and now - self._last_data >= guard.body_idle_timeout:
            guard.hit(Limit.BODY_IDLE_TIMEOUT)
            transport.close()
            return
        if guard.body_timeout and now - self._body_since >= guard.body_timeout:
            guard.hit(Limit.BODY_TIMEOUT)  # a body that keeps coming, too slowly: it holds a slot
            transport.close()
            return
        self._arm(self._body_due())
