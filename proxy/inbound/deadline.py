"""One client connection's deadline: the limit of the phase it is in, and the client that stopped reading.

The deadline moves with the timestamps the connection's events leave behind (the way aiohttp's
own keep-alive timer works), so data arriving costs a clock read, not a timer per chunk; the
guard's watchdog (proxy/inbound/guard.py) looks at it. `ClientConnection` (connection.py) keeps
the timestamps and says what its request is doing (`_body_unread`, `_stalled`, `_front_holds`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from proxy.inbound.front import Front
from proxy.inbound.limits import HEAD_TIMEOUT_RESPONSE, Limit, Phase, unsent
from proxy.watchdog import Watchdog

__all__ = ["Deadlines", "Guard"]


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
    watchdog: Watchdog[Deadlines]
    front: Front | None

    def peer_full(self, peer: str) -> bool:
        """Whether `peer` has max_connections_per_peer connections open already."""

    def fault(self, error: Exception) -> None:
        """Log (throttled) an exception a client's bytes raised in the front: its connection is cut."""

    def request_begun(self) -> None:
        """A request's handler (or the front's exchange) starts."""

    def request_done(self) -> None:
        """It is over."""

    def hit(self, limit: Limit) -> None:
        """Count (and log) one hit of a limit."""

    def opened(self, transport: asyncio.BaseTransport, connection: Any) -> None:  # a ClientConnection
        """A connection was let in."""

    def closed(self, transport: asyncio.BaseTransport) -> None:
        """A connection that was let in is gone."""


class Deadlines:
    """The deadline half of a client connection (a base of `ClientConnection`, which sets these)."""

    _guard: Guard
    _transport: asyncio.Transport | None
    _loop: asyncio.AbstractEventLoop
    _phase: Phase
    _head_since: float
    _last_data: float
    # When the request body began to arrive, moved on by the time the sidecar paused reading:
    # body_timeout counts the client's time only.
    _body_since: float
    _idle_since: float
    _lost: bool  # connection_lost ran: no deadline is armed any more
    _due: float | None  # when the phase's limit is next checked (None: no limit runs)
    # While writing is paused (the client is behind): when to look again, the write buffer's
    # size at the last look, and when the client last took bytes.
    _write_due: float | None
    _write_mark: int
    _write_progress: float

    def _body_unread(self) -> bool:
        raise NotImplementedError

    def _stalled(self) -> None:
        raise NotImplementedError

    def _front_holds(self) -> bool:
        raise NotImplementedError

    def _start_head(self, now: float) -> None:
        """A request head begins: header_timeout runs from `now`."""
        self._phase = Phase.HEAD
        self._head_since = now
        if self._guard.header_timeout:
            self._arm(now + self._guard.header_timeout)

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
        size = unsent(transport)
        if size < self._write_mark:
            self._write_progress = now
        self._write_mark = size  # it may also grow: what was written after writing paused
        if now - self._write_progress < guard.client_write_timeout:
            self._write_due = now + guard.client_write_timeout / 4
            return
        guard.hit(Limit.CLIENT_WRITE_TIMEOUT)
        self._stalled()
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

    def _check(self) -> None:
        """The deadline passed: close the connection if its phase's limit has passed, else re-arm."""
        transport, guard, now = self._transport, self._guard, self._loop.time()
        if transport is None or transport.is_closing():
            return
        if self._phase is Phase.HEAD:
            if now - self._head_since >= guard.header_timeout:
                guard.hit(Limit.HEADER_TIMEOUT)
                transport.write(HEAD_TIMEOUT_RESPONSE)
                transport.close()
            else:
                self._arm(self._head_since + guard.header_timeout)
            return
        if self._phase is Phase.IDLE:
            # Only the front's idle connections have this deadline (aiohttp keeps its own).
            if self._front_holds():
                if now - self._idle_since >= guard.keepalive_timeout:
                    transport.close()
                else:
                    self._arm(self._idle_since + guard.keepalive_timeout)
            return
        if not self._body_unread():
            return  # the body is all in: the response may take as long as the engine needs
        if not transport.is_reading():
            # Paused by flow control: the sidecar is the slow side, not the client; the time
            # since the client was last heard does not count against it either.
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
