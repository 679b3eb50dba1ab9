"""The front: plain inference requests served on httptools, without aiohttp's per-request machinery.

At a deployment's paced load a request's cost is the code it runs, once per wake-up (issue
34): aiohttp builds a web.Request, resolves a route and prepares a StreamResponse for every
one. The client connection (proxy/inbound/connection.py) frames each request itself and, for
one the front takes (proxy/inbound/choice.py), runs here the same exchange as aiohttp's handler
(proxy/forward/engine_exchange.py), its response written as aiohttp would write it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Protocol

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.admin.auth import holds_token
from proxy.admin.middleware import ROUTE_CLASSES
from proxy.admin.policy import RouteClass
from proxy.body_budget import BODY_BUDGET, Reading
from proxy.config import SETTINGS
from proxy.engine_state import ENGINE
from proxy.errors import error_response
from proxy.forward.engine_exchange import admitted_exchange, is_inference, prepare, record_finished
from proxy.forward.exchange import Exchange
from proxy.forward.ids import new_request_id, stored_id
from proxy.forward.services import Services
from proxy.inbound.choice import MAX_FRONT_BODY
from proxy.inbound.head import RequestHead
from proxy.inbound.wire import response_head, sidecar_response
from proxy.logs import log_event
from proxy.observe.overhead import now_ns
from proxy.upstream.head import framed
from proxy.vocabulary import Outcome, ServedBy

__all__ = ["ClientWriter", "Front", "FrontSide", "Shutdown"]

log = logging.getLogger("cachewitness.front")


class Shutdown(Protocol):
    """Whether shutdown began (the connection guard knows)."""

    closing: bool


class Front:
    """The front's app-wide half: what its choice reads (`FrontRules`), and the exchange it runs."""

    def __init__(self, app: web.Application, own: tuple[str, ...], shutdown: Shutdown) -> None:
        """`own`: the starts of the paths the sidecar's own routes answer (proxy/inbound/setup.py)."""
        self.app = app
        # Gathered at startup (proxy/forward/services.py), before the first connection.
        self.services: Services | None = None
        self.budget = app[BODY_BUDGET]
        self.fits = self.budget.fits  # whether a body fits max_buffered_bytes now (`FrontRules`)
        self._settings = app[SETTINGS]
        self._engine = app[ENGINE]
        self._policy = app[ROUTE_CLASSES]
        self._token = self._settings.admin_token
        self.own = own
        self.max_body = min(self._settings.max_body_bytes, MAX_FRONT_BODY)
        # keepalive_timeout = 0: a connection closes after each response (as aiohttp's do).
        self.keeps_alive = self._settings.keepalive_timeout > 0
        # `shutdown.closing`: shutdown began, each connection closes after its response. Read
        # through, not through a property: that is a Python call, twice a request.
        self.shutdown = shutdown

    def holds_admin_token(self, headers: CIMultiDictProxy[str]) -> bool:
        token = self._token
        return token is not None and any(holds_token(name, value, token) for name, value in headers.items())

    def forwards(self, method: str, path: str, query: Mapping[str, str]) -> bool:
        decision = self._policy.classify(method, path, query, self._engine.dialect)
        return decision.route is RouteClass.FORWARDED

    async def serve(self, side: FrontSide, body: bytearray, reading: Reading) -> None:
        """One request, its body in hand and held in the budget: exchanged with the engine, recorded."""
        services, head = side.services, side.request
        request_id = stored_id(head.headers.get("X-Request-Id")) or new_request_id()
        exchange = Exchange(request_id, time.time_ns())
        exchange.buffered = reading
        exchange.read_ns = side.read_ns
        try:
            if side.gone:  # the client left before this began (proxy/inbound/connection.py): not sent
                exchange.outcome = Outcome.CLIENT_DISCONNECTED
                return
            prepared = prepare(services, exchange, body, head.path) if is_inference(services, head) else None
            await admitted_exchange(
                side,
                exchange,
                prepared,
                bytes(body) if prepared is None else None,
                self._settings.max_body_bytes,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug of ours: the client gets a clear 500 (or a cut), the record is kept
            log_event(log, logging.ERROR, "front: request failed", request_id=request_id, error=repr(exc))
            side.fail(exchange)
        finally:
            self.budget.give_back(reading)
            record_finished(services, head, exchange, stalled=side.stalled, served_by=ServedBy.FRONT)


class ClientWriter:
    """The client's transport for one connection, and the wait for a client that is behind."""

    __slots__ = ("_loop", "_resumed", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._resumed: asyncio.Future[None] | None = None

    def pause(self) -> None:
        """The transport's buffer passed its high-water mark."""
        if self._resumed is None:
            self._resumed = self._loop.create_future()

    def resume(self) -> None:
        """The client caught up, or is gone."""
        resumed, self._resumed = self._resumed, None
        if resumed is not None and not resumed.done():
            resumed.set_result(None)

    async def drain(self) -> None:
        """Return once the client has taken what is buffered down to the low-water mark; raise if it is gone."""
        if self._resumed is not None and not self.transport.is_closing():
            await asyncio.shield(self._resumed)
        if self.transport.is_closing():
            raise ConnectionResetError("the client closed its connection")


class FrontSide:
    """An exchange's client side on the front: responses go straight to the client's transport."""

    # `request` and `services` are plain attributes, not properties: the exchange reads them several
    # times a request, and a property is a Python call each time (bench/calls.py, issue 34).
    __slots__ = (
        "_chunked",
        "_front",
        "_head",
        "_writer",
        "read_ns",
        "request",
        "responded",
        "services",
        "stalled",
    )

    served_by = ServedBy.FRONT

    def __init__(self, front: Front, writer: ClientWriter, head: RequestHead) -> None:
        self._front = front
        self._writer = writer
        self.request = head
        assert front.services is not None, "the app has started"
        self.services = front.services
        self.stalled = False
        self.responded = False  # the response's head is out, or on its way
        # Made as the request's last byte is read (proxy/inbound/connection.py): the sidecar's
        # added time starts here (proxy/observe/overhead.py).
        self.read_ns = now_ns()
        self._head: tuple[int, str, CIMultiDict[str]] | None = None
        self._chunked = False

    @property
    def gone(self) -> bool:
        """The client's connection is closing: nothing more can reach it."""
        return self._writer.transport.is_closing()

    async def respond(self, response: web.Response) -> None:
        self.responded = True
        transport = self._writer.transport
        if not transport.is_closing():
            transport.write(sidecar_response(self.request.method, response, keep_alive=self._keep_alive()))

    def response_headers(self, status: int, reason: str) -> CIMultiDict[str]:
        self.responded = True
        headers: CIMultiDict[str] = CIMultiDict()
        self._head = (status, reason, headers)
        return headers

    async def send_head(self, first: bytes) -> tuple[asyncio.Transport, bool]:
        assert self._head is not None, "response_headers comes first"
        status, reason, headers = self._head
        head, chunked = response_head(
            self.request.method, status, reason, headers, keep_alive=self._keep_alive()
        )
        self._chunked = chunked
        transport = self._writer.transport
        if transport.is_closing():
            raise ConnectionResetError("the client closed its connection")
        transport.write(head + framed(first, chunked=chunked) if first else head)
        return transport, chunked

    async def drain(self) -> None:
        await self._writer.drain()

    async def end(self, tail: bytes) -> None:
        transport = self._writer.transport
        if transport.is_closing():
            raise ConnectionResetError("the client closed its connection")
        if tail:
            transport.write(framed(tail, chunked=self._chunked))
        if self._chunked:
            transport.write(b"0\r\n\r\n")

    def cut(self) -> None:
        self._writer.transport.abort()

    def relayed(self) -> None:
        return None

    def fail(self, exchange: Exchange) -> None:
        """An unexpected failure: a 500 when no head went out yet, else the connection cut."""
        transport = self._writer.transport
        if self.responded or transport.is_closing():
            transport.abort()
            return
        exchange.status = 500
        response = error_response(500, "the sidecar failed to serve this request", type_="server_error")
        transport.write(sidecar_response(self.request.method, response, keep_alive=False))
        transport.close()

    def _keep_alive(self) -> bool:
        return self.request.keep_alive and not self._front.shutdown.closing
