"""The keep-alive pool of connections to the engine, and sending one request through it.

Idle connections wait newest-first and leave after `upstream_keepalive_timeout` (below
uvicorn's 5 s, so the pool drops a connection before the engine does). A request whose
reused connection turns out closed before anything was written goes on the next one; once
written, it is never sent again (the engine may have read it).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque

from multidict import CIMultiDict
from yarl import URL

from proxy.logs import log_event
from proxy.upstream.connection import Connection
from proxy.upstream.errors import UpstreamBroke, UpstreamTimeout, UpstreamUnreachable, host_port, os_reason
from proxy.upstream.head import Body, request_head
from proxy.upstream.resend import MOST_STALE_IN_A_ROW
from proxy.upstream.response import UpstreamResponse
from proxy.upstream.response_head import DEFAULT_MAX_HEAD_BYTES
from proxy.watchdog import Watchdog

__all__ = ["UpstreamLeg"]

log = logging.getLogger("cachewitness.pool")


class UpstreamLeg:
    """Connections to one engine base URL: forward's path to the engine."""

    def __init__(
        self,
        base: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        keepalive: float,
        limit: int,
        max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
    ) -> None:
        url = URL(base)
        if url.scheme not in ("http", "https") or url.host is None:
            raise ValueError(f"the upstream leg speaks http(s) to a host, not {url.scheme!r}")
        port = url.port  # yarl fills in the scheme's default
        assert port is not None
        self._host, self._port = url.host, port
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if url.scheme == "https" else None
        netloc = url.host_subcomponent or url.host
        self.host_header = netloc if url.is_default_port() else f"{netloc}:{url.port}"
        self.path_prefix = url.raw_path.rstrip("/")  # an engine mounted under a path keeps it
        self.read_timeout = read_timeout
        self.max_head_bytes = (
            max_head_bytes  # a response head past it is refused (proxy/upstream/response_head.py)
        )
        self._connect_timeout = connect_timeout
        # When (loop time) the engine last answered below 500: traffic that stands in for the
        # health probe while it flows (proxy/health.py).
        self.answered_at: float | None = None
        self._keepalive = keepalive
        self._limit = limit
        self._idle: list[Connection] = []  # oldest first; taken from the end
        self._open: set[Connection] = set()
        self._opening = 0
        self._waiters: deque[asyncio.Future[Connection | None]] = deque()
        self._sweep: asyncio.TimerHandle | None = None
        # Connections reading a response, checked against read_timeout (up to one tick late: a
        # second, or a quarter of a shorter read_timeout).
        self._watchdog: Watchdog[Connection] = Watchdog(min(1.0, read_timeout / 4), self._check_reading)
        self._closed = False
        # The loop, once known: asyncio.get_running_loop() makes a getpid(2) each call (issue 34).
        self._loop: asyncio.AbstractEventLoop | None = None

    async def send(self, method: str, target: str, headers: CIMultiDict[str], body: Body) -> UpstreamResponse:
        """Send one request (`target`: path and query, as the client sent them) and return its response's head.

        Raises UpstreamUnreachable, UpstreamTimeout or UpstreamBroke (UpstreamBadResponse among
        them); or what stopped the client's streamed body (its own exceptions), before the
        response began.
        """
        head, chunked = request_head(method, self.path_prefix + target, self.host_header, headers, body)
        # The same bound as the sidecar's own calls (proxy/upstream/resend.py); the loop is written out
        # here rather than shared through a callback: this is the per-request path.
        for stale_so_far in range(MOST_STALE_IN_A_ROW + 1):
            connection = await self._acquire()
            try:
                return await connection.exchange(head, body, chunked=chunked, head_only=method == "HEAD")
            except UpstreamBroke as exc:
                # Only a request that was never written goes on another connection: one the
                # engine may have read is never sent twice (issue 27), whatever its method.
                if not exc.unsent or stale_so_far == MOST_STALE_IN_A_ROW:
                    raise
                log_event(log, logging.INFO, "stale upstream connection; sending on another", error=str(exc))
        raise AssertionError("unreachable: the last try returns or raises")

    @property
    def queued(self) -> int:
        """Requests waiting for a connection at `upstream_connection_limit`, first come, first served."""
        return sum(1 for waiter in self._waiters if not waiter.done())

    # --- connections -----------------------------------------------------------------------

    async def _acquire(self) -> Connection:
        """An idle connection still within its keep-alive, else a new one (within the limit)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        while self._idle:
            connection = self._idle.pop()
            if loop.time() - connection.idle_since < self._keepalive:
                return connection
            connection.close()
        if self._limit and len(self._open) + self._opening >= self._limit:
            handed = await self._wait_for_one(loop)
            if handed is not None:
                return handed
        return await self._connect(loop)

    async def _wait_for_one(self, loop: asyncio.AbstractEventLoop) -> Connection | None:
        """At the limit: wait for a connection handed back (or None: one closed, open a new one)."""
        waiter: asyncio.Future[Connection | None] = loop.create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and (handed := waiter.result()) is not None:
                self.release(handed)  # handed over just as we gave up: pass it on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> Connection:
        self._opening += 1
        try:
            async with asyncio.timeout(self._connect_timeout or None):
                _, connection = await loop.create_connection(
                    lambda: Connection(self), self._host, self._port, ssl=self._ssl
                )
        except TimeoutError:
            self._wake_one()
            raise UpstreamTimeout(f"no connection to the engine within {self._connect_timeout:g} s") from None
        except OSError as exc:
            self._wake_one()
            where = host_port(self._host, self._port)
            raise UpstreamUnreachable(f"cannot connect to the engine at {where}: {os_reason(exc)}") from exc
        except BaseException:
            self._wake_one()
            raise
        finally:
            self._opening -= 1
        self._open.add(connection)
        return connection

    def release(self, connection: Connection) -> None:
        """A connection whose response is complete: to a waiting request, else to the idle list."""
        if self._closed or self._keepalive <= 0 or connection.lost:
            connection.close()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        loop = self._loop or asyncio.get_running_loop()
        connection.idle_since = loop.time()
        self._idle.append(connection)
        if self._sweep is None:
            self._sweep = loop.call_at(connection.idle_since + self._keepalive, self._sweep_idle)

    def forget(self, connection: Connection) -> None:
        """A connection closed (by either side): it no longer counts, and a waiter may open one."""
        self._open.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _sweep_idle(self) -> None:
        """Close the connections idle past the keep-alive (oldest first), then sleep until the next."""
        self._sweep = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._idle and now - self._idle[0].idle_since >= self._keepalive:
            self._idle.pop(0).close()
        if self._idle:
            self._sweep = loop.call_at(self._idle[0].idle_since + self._keepalive, self._sweep_idle)

    # --- read_timeout ----------------------------------------------------------------------

    def watch(self, connection: Connection) -> None:
        """`connection` starts reading a response: watch it for read_timeout."""
        if self.read_timeout > 0:
            self._watchdog.watch(connection)

    def _check_reading(self, connection: Connection, now: float) -> bool:
        """The watchdog's look at one connection; whether it is still reading a response."""
        connection.check_read_timeout(now, self.read_timeout)
        return connection.waiting

    def close(self) -> None:
        """Close every connection, idle or in use (at shutdown, after the grace period)."""
        self._closed = True
        self._watchdog.close()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
        while self._waiters:
            self._wake_one()
