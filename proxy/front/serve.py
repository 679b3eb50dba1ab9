"""Which requests the front takes, and serving one: the same exchange as aiohttp's handler, answered on the transport."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from aiohttp import web

from proxy.admin.auth import holds_token
from proxy.admin.policy import RouteClass, RoutePolicy
from proxy.body_budget import BODY_BUDGET, Reading
from proxy.config import SETTINGS
from proxy.connections import CONNECTIONS
from proxy.engine_state import ENGINE
from proxy.errors import error_response
from proxy.forward.engine_exchange import admitted_exchange, is_inference, prepare, record_finished
from proxy.forward.exchange import Exchange
from proxy.forward.ids import new_request_id, stored_id
from proxy.front.answer import ClientWriter, relay_answer, sidecar_answer
from proxy.front.head import RequestHead
from proxy.logs import log_event
from proxy.observe.overhead import now_ns
from proxy.upstream import UpstreamResponse
from proxy.vocabulary import Outcome

__all__ = ["Front", "FrontSide"]

log = logging.getLogger("cachewitness.front")

_NO_QUERY: Mapping[str, str] = {}
# A body past this is aiohttp's to read: beside its bytes aiohttp's per-request cost is small, and
# its reader waits for the budget and makes younger readers give way (proxy/body_budget.py), which
# the front, reading inside data_received, cannot. A long-context prompt (~220 KB) stays the front's.
_MAX_BODY = 1024 * 1024


class Front:
    """The front's app-wide half: the heads it takes, and the exchange it runs for each."""

    def __init__(self, app: web.Application, policy: RoutePolicy, own: tuple[str, ...]) -> None:
        """`own`: the starts of the paths the sidecar's own routes answer (proxy/front/__init__.py)."""
        self.app = app
        self.budget = app[BODY_BUDGET]
        self._settings = app[SETTINGS]
        self._engine = app[ENGINE]
        self._policy = policy
        self._own = own
        # keepalive_timeout = 0: a connection closes after each answer (as aiohttp's do).
        self.keeps_alive = self._settings.keepalive_timeout > 0
        self._guard = app[CONNECTIONS]

    @property
    def closing(self) -> bool:
        """Shutdown began: each connection closes after its answer."""
        return self._guard.closing

    def takes(self, head: RequestHead) -> bool:
        """Whether the front serves this head: a POST the route policy forwards, within the limits, without the admin token.

        Everything else aiohttp serves as it always did: the sidecar's own routes, engine
        control routes, a 413, a request whose admin token must be taken out.
        """
        settings = self._settings
        if head.method != "POST" or head.content_length > min(settings.max_body_bytes, _MAX_BODY):
            return False
        if head.path.startswith(self._own):
            return False  # the sidecar's own route (a reset, a case's close): aiohttp's
        if not self.budget.fits(head.content_length):
            return False  # aiohttp streams it unobserved, and counts it
        token = settings.admin_token
        if token is not None and any(holds_token(name, value, token) for name, value in head.headers.items()):
            return False
        decision = self._policy.classify(head.method, head.path, _NO_QUERY, self._engine.dialect)
        return decision.route is RouteClass.FORWARDED

    async def serve(self, side: FrontSide, body: bytearray, reading: Reading) -> None:
        """One request, its body in hand and held in the budget: exchanged with the engine, recorded."""
        app, head = self.app, side.request
        request_id = stored_id(head.headers.get("X-Request-Id")) or new_request_id()
        exchange = Exchange(request_id, time.time_ns())
        exchange.buffered = reading
        exchange.read_ns = side.read_ns
        try:
            if side.gone:  # the client left before this began (proxy/front/connection.py): not sent
                exchange.outcome = Outcome.CLIENT_DISCONNECTED
                return
            prepared = prepare(app, exchange, body, head.path) if is_inference(app, head) else None
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
            record_finished(app, head, exchange, stalled=side.stalled)


class FrontSide:
    """An exchange's client side on the front: answers go straight to the client's transport."""

    # `request` and `app` are plain attributes, not properties: the exchange reads them several
    # times a request, and a property is a Python call each time (bench/calls.py, issue 34).
    __slots__ = ("_front", "_writer", "answered", "app", "read_ns", "request", "stalled")

    def __init__(self, front: Front, writer: ClientWriter, head: RequestHead) -> None:
        self._front = front
        self._writer = writer
        self.request = head
        self.app = front.app
        self.stalled = False
        self.answered = False  # the answer's head went out
        # Made as the request's last byte is read (proxy/front/connection.py): the sidecar's
        # added time starts here (proxy/observe/overhead.py).
        self.read_ns = now_ns()

    @property
    def gone(self) -> bool:
        """The client's connection is closing: nothing more can reach it."""
        return self._writer.transport.is_closing()

    async def answer(self, response: web.Response) -> None:
        self.answered = True
        transport = self._writer.transport
        if not transport.is_closing():
            transport.write(sidecar_answer(self.request.method, response, keep_alive=self._keep_alive()))

    async def relay(self, upstream: UpstreamResponse, exchange: Exchange, peeked: bytes) -> None:
        self.answered = True
        await relay_answer(
            self._front.app,
            self._writer,
            upstream,
            exchange,
            peeked,
            budget=self._front.budget,
            keep_alive=self._keep_alive(),
        )

    def fail(self, exchange: Exchange) -> None:
        """An unexpected failure: a 500 when no head went out yet, else the connection cut."""
        transport = self._writer.transport
        if self.answered or transport.is_closing():
            transport.abort()
            return
        exchange.status = 500
        response = error_response(500, "the sidecar failed to serve this request", type_="server_error")
        transport.write(sidecar_answer(self.request.method, response, keep_alive=False))
        transport.close()

    def _keep_alive(self) -> bool:
        return self.request.keep_alive and not self._front.closing
