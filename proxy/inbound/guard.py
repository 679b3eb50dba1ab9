"""Client connections: the head and body-idle timeouts, the connection cap, and the in-flight count.

aiohttp closes an idle keep-alive connection, but not one that sends nothing, half a request
line, headers without the final CRLF, or a body that stops: each would hold a file descriptor
for ever, and enough of them starve the sidecar of descriptors for its own upstream
connections. Every client connection is therefore wrapped: the wrapper refuses connections
past `max_connections` with a clear 503 and close, and closes a connection whose head takes
longer than `header_timeout` or whose body goes silent for `body_idle_timeout`. A client that
stops reading its response holds the relay's buffer and an engine connection: one that takes no
byte for `client_write_timeout` while the sidecar waits on it is cut (its handler is cancelled,
which aborts the engine's request), and its exchange's outcome is `client_stalled`.

Past `max_connections` a few more connections (PROBE_SLOTS) are let in for the probes only:
their first request must be `/-/healthy` or `/-/ready`, answered and closed, so a flood that
holds every slot does not get the pod restarted by its own liveness probe. `health_listen`
(proxy/probe_listener.py) is the sturdier answer: a listener of its own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from proxy.config import SETTINGS
from proxy.inbound.connection import ClientConnection
from proxy.inbound.deadline import Deadlines
from proxy.inbound.front import Front
from proxy.inbound.limits import REFUSAL_BODY, Limit, Phase
from proxy.logs import LogThrottle, log_event
from proxy.watchdog import Watchdog

__all__ = ["CONNECTIONS", "PROBE_PATHS", "PROBE_SLOTS", "ConnectionGuard", "setup_connections"]

log = logging.getLogger("cachewitness.connections")

# The probe routes, and the connections past max_connections kept for them (the kubelet opens
# one connection per probe, and there are three probes).
PROBE_PATHS = frozenset({"/-/healthy", "/-/ready"})
PROBE_SLOTS = 8


class ConnectionGuard:
    """Counts client connections and requests in progress, and enforces the limits."""

    def __init__(
        self,
        header_timeout: float,
        body_idle_timeout: float,
        max_connections: int,
        probe_slots: int = 0,
        client_write_timeout: float = 0.0,
        keepalive_timeout: float = 0.0,
        body_timeout: float = 0.0,
        max_connections_per_peer: int = 0,
    ) -> None:
        """Limits in seconds and connections; 0 turns one off. `probe_slots`: past max_connections, for probes."""
        self.header_timeout = header_timeout
        self.body_idle_timeout = body_idle_timeout
        self.body_timeout = body_timeout
        self.max_connections_per_peer = max_connections_per_peer
        self._per_peer: dict[str, int] = {}  # open connections by peer address (with the cap set)
        self.client_write_timeout = client_write_timeout
        self.keepalive_timeout = keepalive_timeout  # aiohttp's own, and the front's connections'
        # The front, which serves beside aiohttp on each new connection (proxy/inbound/setup.py);
        # None: aiohttp serves every request.
        self.front: Front | None = None
        self.closing = False  # shutdown began: no connection is kept alive after its response
        self.max_connections = max_connections
        self.probe_slots = probe_slots
        self.open_connections = 0
        self.requests_in_progress = 0
        self.hits: dict[Limit, int] = dict.fromkeys(Limit, 0)
        self._throttle = LogThrottle()
        self._connections: dict[asyncio.BaseTransport, ClientConnection] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        # Connections with a deadline: a limit is enforced up to one tick late (a second, or a
        # quarter of the shortest limit).
        limits = [
            limit / 4
            for limit in (header_timeout, body_idle_timeout, client_write_timeout, body_timeout)
            if limit > 0
        ]
        self.watchdog: Watchdog[Deadlines] = Watchdog(min([1.0, *limits]), Deadlines.check_deadline)

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
        return lambda: ClientConnection(self, server)

    async def guarded(
        self, request: web.BaseRequest, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Mark the connection's head as complete and count the request while its handler runs."""
        connection = self._connections.get(request.transport) if request.transport is not None else None
        if connection is not None:
            connection.request_started(request)
        self.request_begun()
        try:
            if connection is None or not connection.probe_only:
                return await handler(request)
            if request.path not in PROBE_PATHS:
                self.hit(Limit.MAX_CONNECTIONS)
                response: web.StreamResponse = web.Response(
                    status=503,
                    body=REFUSAL_BODY,
                    content_type="application/json",
                    headers={"Retry-After": "1"},
                )
            else:
                response = await handler(request)
            response.force_close()  # a probe slot serves one request
            return response
        finally:
            self.request_done()
            if connection is not None:
                connection.request_finished()

    def request_begun(self) -> None:
        """A request's handler (or the front's exchange) starts: shutdown waits for it."""
        self.requests_in_progress += 1
        if self.requests_in_progress == 1:  # set only at 0: cleared once, not per request (a call)
            self._idle.clear()

    def request_done(self) -> None:
        """It is over."""
        self.requests_in_progress -= 1
        if self.requests_in_progress == 0:
            self._idle.set()

    async def wait_requests_done(self, timeout_s: float) -> bool:
        """Wait until no request is in progress, up to `timeout_s`; whether that happened."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
        except TimeoutError:
            return False
        return True

    def close_idle(self) -> None:
        """Close every client connection with no request in progress (shutdown: nothing is cut)."""
        self.closing = True
        for transport, connection in list(self._connections.items()):
            if connection.phase is not Phase.REQUEST:
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

    def fault(self, error: Exception) -> None:
        """Log an exception a client's bytes raised in the front, with its traceback, throttled."""
        faults = self._throttle.due("fault")
        if faults:
            log.error(
                "front: a client's bytes raised; its connection is cut",
                exc_info=error,
                extra={"faults": faults},
            )

    def _limit_value(self, limit: Limit) -> float:
        """The configured value of a limit, for the log line."""
        if limit is Limit.HEADER_TIMEOUT:
            return self.header_timeout
        if limit is Limit.BODY_IDLE_TIMEOUT:
            return self.body_idle_timeout
        if limit is Limit.CLIENT_WRITE_TIMEOUT:
            return self.client_write_timeout
        if limit is Limit.BODY_TIMEOUT:
            return self.body_timeout
        if limit is Limit.MAX_CONNECTIONS_PER_PEER:
            return self.max_connections_per_peer
        return self.max_connections

    def peer_full(self, peer: str) -> bool:
        """Whether `peer` has max_connections_per_peer connections open already."""
        return (
            bool(self.max_connections_per_peer)
            and self._per_peer.get(peer, 0) >= self.max_connections_per_peer
        )

    def receiving_bodies(self) -> int:
        """Client connections whose request body is still arriving (at a scrape: each connection looked at)."""
        return sum(1 for connection in self._connections.values() if connection.receiving_body)

    def opened(self, transport: asyncio.BaseTransport, connection: ClientConnection) -> None:
        """A connection was let in: count it."""
        self.open_connections += 1
        self._connections[transport] = connection
        if self.max_connections_per_peer:
            self._per_peer[connection.peer] = self._per_peer.get(connection.peer, 0) + 1

    def closed(self, transport: asyncio.BaseTransport) -> None:
        """A connection that was let in is gone."""
        connection = self._connections.pop(transport, None)
        if connection is None:
            return
        self.open_connections -= 1
        count = self._per_peer.get(connection.peer, 0) - 1
        if count > 0:
            self._per_peer[connection.peer] = count
        else:
            self._per_peer.pop(connection.peer, None)


CONNECTIONS = web.AppKey("connections", ConnectionGuard)


def setup_connections(app: web.Application) -> ConnectionGuard:
    """Create the app's ConnectionGuard (its GuardedSite puts it in front of every request)."""
    settings = app[SETTINGS]
    guard = ConnectionGuard(
        settings.header_timeout,
        settings.body_idle_timeout,
        settings.max_connections,
        PROBE_SLOTS,
        settings.client_write_timeout,
        settings.keepalive_timeout,
        settings.body_timeout,
        settings.max_connections_per_peer,
    )
    app[CONNECTIONS] = guard
    return guard
