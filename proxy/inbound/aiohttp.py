"""aiohttp's side: every request the front does not take, through aiohttp's handler and the route policy.

What the front and aiohttp share, from the drain gate on, is proxy/forward/engine_exchange.py;
the engine's response goes out through the relay (proxy/forward/relay.py) onto `AiohttpSide`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict

from proxy.body_budget import BodyBudget
from proxy.forward.client import BodyTooLarge, ClientGone
from proxy.forward.engine_exchange import (
    admitted_exchange,
    is_inference,
    prepare,
    record_finished,
    rejected,
    too_large,
)
from proxy.forward.exchange import Exchange
from proxy.forward.ids import new_request_id, stored_id
from proxy.forward.refusal import refusal
from proxy.forward.services import SERVICES, Services
from proxy.inbound.connection import read_mark
from proxy.inbound.limits import CLIENT_STALLED
from proxy.inbound.request_body import BodyStart, limited_body, read_within_budget
from proxy.inbound.wire import HeldHeadResponse, send_held_head
from proxy.logs import log_event
from proxy.observe import PreparedRequest
from proxy.upstream import Body
from proxy.vocabulary import Outcome, ServedBy

__all__ = ["AiohttpSide", "forward"]

log = logging.getLogger("cachewitness.forward")


class AiohttpSide:
    """An exchange's client side on aiohttp: the handler returns the response, aiohttp sends it."""

    __slots__ = ("_request", "_response", "_writer", "services")

    served_by = ServedBy.AIOHTTP

    def __init__(self, request: web.Request, services: Services) -> None:
        self._request = request
        self.services = services
        self._response: HeldHeadResponse | None = None
        self._writer: AbstractStreamWriter | None = None

    @property
    def request(self) -> web.Request:
        return self._request

    async def respond(self, response: web.Response) -> web.StreamResponse:
        return response

    def response_headers(self, status: int, reason: str) -> CIMultiDict[str]:
        self._response = HeldHeadResponse(status=status, reason=reason)
        return self._response.headers

    async def send_head(self, first: bytes) -> tuple[asyncio.Transport, bool]:
        response = self._relayed()
        writer = self._writer = await response.prepare(self._request)
        assert writer is not None  # a fresh response: prepare() starts it
        await send_held_head(response, writer, first)
        transport = self._request.transport
        if transport is None:
            raise ConnectionResetError("the client closed its connection")
        return transport, response.headers.get(hdrs.TRANSFER_ENCODING, "").lower() == "chunked"

    async def drain(self) -> None:
        if self._writer is not None:
            await self._writer.drain()

    async def end(self, tail: bytes) -> None:
        response = self._relayed()
        if tail:
            await response.write(tail)
        await response.write_eof()

    def cut(self) -> None:
        if self._request.transport is not None:
            self._request.transport.abort()

    def relayed(self) -> web.StreamResponse:
        return self._relayed()

    def _relayed(self) -> HeldHeadResponse:
        response = self._response
        if response is None:
            raise RuntimeError("the relay writes before the response began")
        return response


async def forward(request: web.Request) -> web.StreamResponse:
    """Proxy one request to the upstream and stream the response back."""
    # The client's id when it sent one; else 32 random hex digits, as uuid4().hex gave but
    # without building a UUID (issue 19) nor a system call per request (issue 34).
    request_id = stored_id(request.headers.get("X-Request-Id")) or new_request_id()
    exchange = Exchange(request_id, time.time_ns())
    exchange.read_ns = read_mark(request)  # the head's last byte; the body's, once read
    services = request.app[SERVICES]
    try:
        refused = refusal(request)
        if refused is not None:
            log_event(
                log,
                logging.WARNING,
                f"request refused: {refused.code}",
                request_id=exchange.request_id,
                header=refused.header,
            )
            return rejected(exchange, refused.response())
        return await _exchange_within_limit(request, exchange, services)
    finally:
        stalled = request.get(CLIENT_STALLED, False)
        record_finished(services, request, exchange, stalled=stalled, served_by=ServedBy.AIOHTTP)


async def _exchange_within_limit(
    request: web.Request, exchange: Exchange, services: Services
) -> web.StreamResponse:
    """Refuse a body past max_body_bytes; the budget taken while reading it is given back at the end."""
    limit = services.settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        return rejected(exchange, too_large(limit))
    try:
        return await _observe_and_exchange(request, exchange, services)
    finally:
        if exchange.buffered is not None:
            services.budget.give_back(exchange.buffered)


async def _observe_and_exchange(
    request: web.Request, exchange: Exchange, services: Services
) -> web.StreamResponse:
    """Read an inference request's body within the budget, then admit and exchange."""
    limit, budget = services.settings.max_body_bytes, services.budget
    prepared: PreparedRequest | None = None
    start: BodyStart | None = None
    if is_inference(services, request):
        try:
            body, complete = await read_within_budget(request, limit, budget, exchange)
        except BodyTooLarge:
            return rejected(exchange, too_large(limit))
        except ClientGone:
            exchange.outcome = Outcome.CLIENT_DISCONNECTED
            raise asyncio.CancelledError from None
        exchange.read_ns = read_mark(request)
        if complete:
            prepared = prepare(services, exchange, body, request.path)
        else:
            start = BodyStart(body)
            budget.passed_unobserved(exchange.request_id, request.content_length)
        del body  # the start of a body that did not fit is freed once sent (BodyStart)
    streamed: Body = None
    if prepared is None and request.body_exists:
        streamed = limited_body(request, limit, start, _give_back(budget, exchange))
    return await admitted_exchange(AiohttpSide(request, services), exchange, prepared, streamed, limit)


def _give_back(budget: BodyBudget, exchange: Exchange) -> Callable[[], None]:
    """Give back the budget a body that did not fit took, once the engine has its start (the rest streams)."""

    def give_back() -> None:
        if exchange.buffered is not None:
            budget.give_back(exchange.buffered)

    return give_back
