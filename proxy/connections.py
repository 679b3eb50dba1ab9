"""Client connections: the head and body-idle timeouts, the connection cap, and the in-flight count.

aiohttp closes an idle keep-alive connection, but not one that sends nothing, half a request
line, headers without the final CRLF, or a body that stops: each would hold a file descriptor
for ever, and enough of them starve the sidecar of descriptors for its own upstream
connections. Every client connection is therefore wrapped: the wrapper refuses connections
past `max_connections` with a clear 503 and close, and closes a connection whose head takes
longer than `header_timeout` or whose body goes silent for `body_idle_timeout`. A client that
stops reading its answer holds the relay's buffer and an engine connection: one that takes no
byte for `client_write_timeout` while the sidecar waits on it is cut (its handler is cancelled,
which aborts the engine's request), and its exchange's outcome is `client_stalled`.

Past `max_connections` a few more connections (PROBE_SLOTS) are let in for the probes only:
their first request must be `/-/healthy` or `/-/ready`, answered and closed, so a flood that
holds every slot does not get the pod restarted by its own liveness probe. `health_listen`
(proxy/probe_listener.py) is the sturdier answer: a listener of its own.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import logging
import sys
import termios
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import cast

import orjson
from aiohttp import web
from yarl import URL

from proxy.config import SETTINGS
from proxy.logs import LogThrottle, log_event
from proxy.watchdog import Watchdog

__all__ = [
    "CLIENT_STALLED",
    "CONNECTIONS",
    "PROBE_PATHS",
    "PROBE_SLOTS",
    "ConnectionGuard",
    "GuardedSite",
    "Limit",
    "setup_connections",
]

log = logging.getLogger("cachewitness.connections")

# SIOCOUTQ (Linux's TIOCOUTQ on a socket): bytes in the send queue the peer has not acknowledged.
_OUTQ: int | None = getattr(termios, "TIOCOUTQ", None) if sys.platform == "linux" else None

_REFUSAL_BODY = orjson.dumps(
    {
        "error": {
            "message": "the sidecar has max_connections client connections open; retry shortly",
            "type": "service_unavailable",
            "code": "too_many_connections",
        }
    }
)
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json\r\n"
    b"Retry-After: 1\r\n"
    b"Connection: close\r\n"
    b"Content-Length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY
)
_HEAD_TIMEOUT_ANSWER = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"

# The probe routes, and the connections past max_connections kept for them (the kubelet opens
# one connection per probe, and there are three probes).
PROBE_PATHS = frozenset({"/-/healthy", "/-/ready"})
PROBE_SLOTS = 8


class Limit(StrEnum):
    """The connection limits, as metric labels and log words."""

    HEADER_TIMEOUT = "header_timeout"
    BODY_IDLE_TIMEOUT = "body_idle_timeout"
    CLIENT_WRITE_TIMEOUT = "client_write_timeout"
    MAX_CONNECTIONS = "max_connections"


class _Phase(StrEnum):
    """Where a connection is in its request cycle."""

    HEAD = "head"  # waiting for (the rest of) a request head: header_timeout runs
    REQUEST = "request"  # a handler runs: body_idle_timeout runs while the body is unread
    IDLE = "idle"  # keep-alive between requests: aiohttp's keepalive_timeout applies (serve.py sets it)


class ConnectionGuard:
    """Counts client connections and requests in progress, and enforces the limits."""

    def __init__(
        self,
        header_timeout: float,
        body_idle_timeout: float,
        max_connections: int,
        probe_slots: int = 0,
        client_write_timeout: float = 0.0,
    ) -> None:
        """Limits in seconds and connections; 0 turns one off. `probe_slots`: past max_connections, for probes."""
        self.header_timeout = header_timeout
        self.body_idle_timeout = body_idle_timeout
        self.client_write_timeout = client_write_timeout
        self.max_connections = max_connections
        self.probe_slots = probe_slots
        self.open_connections = 0
        self.requests_in_progress = 0
        self.hits: dict[Limit, int] = dict.fromkeys(Limit, 0)
        self._throttle = LogThrottle()
        self._connections: dict[asyncio.BaseTransport, _GuardedConnection] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        # Connections with a deadline: a limit is enforced up to one tick late (a second, or a
        # quarter of the shortest limit).
        limits = [
            limit / 4 for limit in (header_timeout, body_idle_timeout, client_write_timeout) if limit > 0
        ]
        self.watchdog: Watchdog[_GuardedConnection] = Watchdog(
            min([1.0, *limits]), _GuardedConnection.check_deadline
        )

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for `loop.create_server` that wraps aiohttp's request handler.

        Every request the server handles goes through `guarded` first: the server's request
        handler is wrapped (once), outside the app's router, so requests no route matches are
        counted too. Not an app middleware: with none, aiohttp skips its middleware chain for
        every request (issue 34).
        """
        handler = server.request_handler
        if getattr(handler, "func", None) != self.guarded:
            server.request_handler = functools.partial(self.guarded, handler=handler)
        return lambda: _GuardedConnection(self, server)

    async def guarded(
        self, request: web.BaseRequest, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Mark the connection's head as complete and count the request while its handler runs."""
        connection = self._connections.get(request.transport) if request.transport is not None else None
        if connection is not None:
            connection.request_started(request)
        self.requests_in_progress += 1
        self._idle.clear()
        try:
            if connection is None or not connection.probe_only:
                return await handler(request)
            if request.path not in PROBE_PATHS:
                self.hit(Limit.MAX_CONNECTIONS)
                response: web.StreamResponse = web.Response(
                    status=503,
                    body=_REFUSAL_BODY,
                    content_type="application/json",
                    headers={"Retry-After": "1"},
                )
            else:
                response = await handler(request)
            response.force_close()  # a probe slot serves one request
            return response
        finally:
            self.requests_in_progress -= 1
            if self.requests_in_progress == 0:
                self._idle.set()
            if connection is not None:
                connection.request_finished()

    async def wait_requests_done(self, timeout_s: float) -> bool:
        """Wait until no request is in progress, up to `timeout_s`; whether that happened."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
        except TimeoutError:
            return False
        return True

    def close_idle(self) -> None:
        """Close every client connection with no request in progress (shutdown: nothing is cut)."""
        for transport, connection in list(self._connections.items()):
            if connection.phase is not _Phase.REQUEST:
                transport.close()

    def close_all(self) -> None:
        """Close every client connection (the grace period is over: handlers are cancelled)."""
        for transport in list(self._connections):
            transport.close()

    def hit(self, limit: Limit) -> None:
        """Count one hit of a limit; log a warning (throttled per limit)."""
        self.hits[limit] += 1
        hits = self._throttle.due(limit)
        if hits:
            log_event(
                log,
                logging.WARNING,
                "client connection limit hit",
                limit=str(limit),
                value=self._limit_value(limit),
                hits=hits,
                open_connections=self.open_connections,
            )

    def _limit_value(self, limit: Limit) -> float:
        """The configured value of a limit, for the log line."""
        if limit is Limit.HEADER_TIMEOUT:
            return self.header_timeout
        if limit is Limit.BODY_IDLE_TIMEOUT:
            return self.body_idle_timeout
        if limit is Limit.CLIENT_WRITE_TIMEOUT:
            return self.client_write_timeout
        return self.max_connections

    def _opened(self, transport: asyncio.BaseTransport, connection: _GuardedConnection) -> None:
        self.open_connections += 1
        self._connections[transport] = connection

    def _closed(self, transport: asyncio.BaseTransport) -> None:
        if self._connections.pop(transport, None) is not None:
            self.open_connections -= 1


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


class _GuardedConnection(asyncio.Protocol):
    """One client connection: aiohttp's request handler, with one deadline the guard's watchdog checks.

    The deadline moves with the timestamps the events leave behind (the way aiohttp's own
    keep-alive timer works), so data arriving costs a clock read, not a timer per chunk.
    """

    def __init__(self, guard: ConnectionGuard, server: web.Server) -> None:
        self._guard = guard
        self._server = server
        self._handler: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._phase = _Phase.HEAD
        self._head_since = self._loop.time()
        self._last_data = self._head_since
        self._request: web.BaseRequest | None = None
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
        if guard.max_connections and guard.open_connections >= guard.max_connections:
            self.probe_only = True
        if self.probe_only and guard.open_connections >= guard.max_connections + guard.probe_slots:
            guard.hit(Limit.MAX_CONNECTIONS)
            # Closed at once, not lingered: under a flood the descriptor is what must be freed. A
            # client whose request was already sent may then see a reset instead of the 503.
            transport.write(_REFUSAL)
            transport.close()
            return
        self._transport = transport
        guard._opened(transport, self)
        self._handler = self._server()
        self._handler.connection_made(transport)
        self._arm(self._head_since + guard.header_timeout if guard.header_timeout else None)

    def data_received(self, data: bytes) -> None:
        """Note the time; the first byte after an idle keep-alive starts the next head's clock."""
        if self._handler is None:
            return  # a refused connection: its bytes are discarded
        now = self._loop.time()
        self._last_data = now
        if self._phase is _Phase.IDLE:
            self._phase = _Phase.HEAD
            self._head_since = now
            if self._guard.header_timeout:
                self._arm(now + self._guard.header_timeout)
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        """aiohttp decides what a half-close means."""
        return self._handler.eof_received() if self._handler is not None else False

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection and tell aiohttp (which cancels a running handler)."""
        self._disarm()
        self._write_due = None
        if self._handler is None:
            return
        if self._transport is not None:
            self._guard._closed(self._transport)
        self._handler.connection_lost(exc)

    def pause_writing(self) -> None:
        """Flow control is aiohttp's; client_write_timeout starts running."""
        timeout = self._guard.client_write_timeout
        if timeout and self._transport is not None:
            self._write_progress = self._loop.time()
            self._write_mark = _unsent(self._transport)
            self._write_due = self._write_progress + timeout / 4
            self._guard.watchdog.watch(self)
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        """Flow control is aiohttp's; the client caught up."""
        self._write_due = None
        if self._handler is not None:
            self._handler.resume_writing()

    @property
    def phase(self) -> _Phase:
        """Where the connection is in its request cycle."""
        return self._phase

    # --- the request cycle, from the guard's `guarded` ------------------------------------

    def request_started(self, request: web.BaseRequest) -> None:
        """The head is complete: header_timeout stops; body_idle_timeout runs while the body is unread."""
        self._phase = _Phase.REQUEST
        self._request = request
        self._last_data = self._loop.time()
        idle = self._guard.body_idle_timeout
        self._arm(self._last_data + idle if idle and not request.content.is_eof() else None)

    def request_finished(self) -> None:
        """Back to keep-alive idle: the next request's first byte starts its head clock."""
        self._request = None
        self._phase = _Phase.IDLE
        self._disarm()

    # --- the deadline -----------------------------------------------------------------------

    def _arm(self, when: float | None) -> None:
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
        transport.abort()  # nothing more can reach this client; connection_lost cancels the handler

    def _check(self) -> None:
        """The deadline passed: close the connection if its phase's limit has passed, else re-arm."""
        transport, guard, now = self._transport, self._guard, self._loop.time()
        if transport is None or transport.is_closing():
            return
        if self._phase is _Phase.HEAD:
            if now - self._head_since >= guard.header_timeout:
                guard.hit(Limit.HEADER_TIMEOUT)
                transport.write(_HEAD_TIMEOUT_ANSWER)
                transport.close()
            else:
                self._arm(self._head_since + guard.header_timeout)
            return
        request = self._request
        if self._phase is not _Phase.REQUEST or request is None or request.content.is_eof():
            return  # the body is all in: the response may take as long as the engine needs
        if not transport.is_reading():
            # Paused by aiohttp's flow control: the sidecar is the slow side, not the client.
            self._last_data = now
        elif now - self._last_data >= guard.body_idle_timeout:
            guard.hit(Limit.BODY_IDLE_TIMEOUT)
            transport.close()
            return
        self._arm(self._last_data + guard.body_idle_timeout)


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through the app's ConnectionGuard."""

    def __init__(
        self, runner: web.BaseRunner, guard: ConnectionGuard, host: str, port: int, *, backlog: int = 1024
    ) -> None:
        """Listen on host:port (port 0 picks a free one: see `port`)."""
        super().__init__(runner, backlog=backlog)
        self._guard = guard
        self._host = host
        self._port = port
        self._listener: asyncio.Server | None = None

    @property
    def name(self) -> str:
        """The URL this site serves."""
        return str(URL.build(scheme="http", host=self._host, port=self.port))

    @property
    def port(self) -> int:
        """The bound port (the one asked for, until started)."""
        if self._listener is not None and self._listener.sockets:
            return int(self._listener.sockets[0].getsockname()[1])
        return self._port

    async def start(self) -> None:
        """Bind and start accepting."""
        await super().start()
        server = self._runner.server
        assert server is not None, "runner.setup() must run before site.start()"
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            self._guard.protocol_factory(server),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
        )
        self._server = self._listener  # what BaseSite.stop() closes


CONNECTIONS = web.AppKey("connections", ConnectionGuard)
# Set on a request whose client was cut by client_write_timeout.
CLIENT_STALLED = web.RequestKey("client_stalled", bool)


def setup_connections(app: web.Application) -> ConnectionGuard:
    """Create the app's ConnectionGuard (its GuardedSite puts it in front of every request)."""
    settings = app[SETTINGS]
    guard = ConnectionGuard(
        settings.header_timeout,
        settings.body_idle_timeout,
        settings.max_connections,
        PROBE_SLOTS,
        settings.client_write_timeout,
    )
    app[CONNECTIONS] = guard
    return guard
