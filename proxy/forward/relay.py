"""The engine's response on its way to the client: the head, then the body as it arrives, read in passing.

One relay for both servers: each implements the client wire (`ClientSide`, proxy/forward/client.py).
The body goes from the leg's connection callback straight onto the client's transport
(`UpstreamResponse.relay` with a sink): no task wakes up and no server's writer runs per piece
(bench/paced_streams.py, issue 19: 28.7 → 24.5 µs of CPU per SSE event when the engine
paces its events, each relayed alone). Only the head with what is in hand, the scanner's tail
and the end go through the server's side, which frames them the same way (chunked when the
head says so).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from multidict import CIMultiDict

from proxy.body_budget import BodyBudget
from proxy.config import Settings
from proxy.forward.client import ClientSide
from proxy.forward.exchange import Exchange
from proxy.forward.headers import OVERHEAD_HEADER, add_response_headers
from proxy.logs import log_event
from proxy.observe import JsonBody, StreamScanner, rules_for
from proxy.observe.overhead import elapsed_us, now_ns
from proxy.upstream import UpstreamBadResponse, UpstreamError, UpstreamResponse
from proxy.upstream.head import framed
from proxy.upstream.response import HIGH_WATER, Sink
from proxy.vocabulary import Outcome

__all__ = [
    "answered",
    "broke_mid_response",
    "client_headers",
    "client_sink",
    "drained",
    "relay",
    "start_observing",
]

log = logging.getLogger("cachewitness.forward")

# What each body piece goes through on its way: the SSE scanner (which may hold back or
# rewrite bytes) or the JSON reader (which only reads); None when the response is not observed.
Observe = Callable[[bytes], bytes]


def start_observing(upstream: UpstreamResponse, exchange: Exchange, *, sse: bool) -> Observe | None:
    """Pick how the response is read for usage: the SSE scanner, or a bounded JSON reader.

    A compressed response is not read (the sidecar never decompresses): its usage is unknown.
    """
    if not exchange.observed:
        return None
    if upstream.headers.get("Content-Encoding", "identity").lower() != "identity":
        return None
    if sse:
        engine = exchange.engine_info
        scanner = StreamScanner(rules_for(engine) if exchange.usage_injected else None)
        exchange.scanner = scanner
        return scanner.feed
    json_body = JsonBody()
    exchange.json_body = json_body

    def read_json(chunk: bytes) -> bytes:
        json_body.feed(chunk)
        return chunk

    return read_json


def broke_mid_response(exchange: Exchange, exc: UpstreamError) -> None:
    """The engine's answer broke after its head: the outcome, and a warning (the caller cuts the client)."""
    exchange.outcome = Outcome.TIMEOUT if isinstance(exc, TimeoutError) else Outcome.UPSTREAM_ERROR
    exchange.bad_answer = isinstance(exc, UpstreamBadResponse)
    log_event(
        log,
        logging.WARNING,
        "upstream broke mid-response",
        request_id=exchange.request_id,
        error=type(exc).__name__,
    )


def answered(exchange: Exchange, upstream: UpstreamResponse, *, with_body: bool) -> Callable[[], None] | None:
    """The answer's first bytes are written to the client: its `added_out_us` is measured now.

    A stream whose head went out alone is measured at its first event instead (the engine's time
    to that event is not the sidecar's): the mark to make then is returned, for `client_sink`.
    """
    if with_body or not exchange.event_stream:
        exchange.added_out_us = elapsed_us(upstream.answer_read_ns, now_ns())
        return None

    def first_event() -> None:
        exchange.added_out_us = elapsed_us(upstream.body_read_ns, now_ns())

    return first_event


def client_sink(
    transport: asyncio.Transport,
    observe: Observe | None,
    *,
    chunked: bool,
    first_event: Callable[[], None] | None = None,
) -> Sink:
    """Write each body piece to the client as it comes; True when the client is behind.

    Behind is the client's unsent bytes past the mark the leg's own buffer stops at, and past
    the transport's own high-water mark too: the transport has then paused
    writing, which is what the relay's `drain()` waits out (below it, drain returns at once).
    `first_event` (from `answered`) is called once, after the first piece written.
    """
    behind = max(HIGH_WATER, transport.get_write_buffer_limits()[1])

    def sink(chunk: bytes) -> bool:
        nonlocal first_event
        if observe is not None:
            chunk = observe(chunk)
            if not chunk:
                return False  # the scanner holds a partial event
        if transport.is_closing():
            raise ConnectionResetError("the client closed its connection")
        transport.write(framed(chunk, chunked=chunked))
        if first_event is not None:
            first_event()
            first_event = None
        return transport.get_write_buffer_size() > behind

    return sink


def drained(
    budget: BodyBudget, transport: asyncio.Transport, drain: Callable[[], Awaitable[None]]
) -> Callable[[], Awaitable[None]]:
    """Wait (`drain`) for a client that is behind; what waits for it counts in max_buffered_bytes meanwhile.

    A client that stops reading is cut by client_write_timeout (proxy/inbound/connection.py).
    """

    async def wait() -> None:
        held = transport.get_write_buffer_size()
        budget.hold(held)
        try:
            await drain()
        finally:
            budget.release(held)

    return wait


def client_headers(
    upstream: UpstreamResponse, exchange: Exchange, into: CIMultiDict[str], settings: Settings
) -> Observe | None:
    """The response's status and headers for the client (`into`), and how its body is read on the way."""
    exchange.status = upstream.status
    sse = exchange.event_stream = upstream.content_type == "text/event-stream"
    add_response_headers(
        upstream.headers,
        into,
        request_id=exchange.request_id,
        usage_injected=exchange.usage_injected,
        sse=sse,
        add_request_id=settings.request_id_header,
    )
    if settings.overhead_header:
        # The time added so far: the request's way in, and the answer's until its head is built.
        added = (exchange.added_in_us or 0) + elapsed_us(upstream.answer_read_ns, now_ns())
        into[OVERHEAD_HEADER] = str(added)
    return start_observing(upstream, exchange, sse=sse)


async def relay(
    side: ClientSide[Any], upstream: UpstreamResponse, exchange: Exchange, peeked: bytes = b""
) -> None:
    """Stream the engine's response to the client as it arrives (`peeked`: its start, already read)."""
    services = side.services
    headers = side.response_headers(upstream.status, upstream.reason)
    observe = client_headers(upstream, exchange, headers, services.settings)
    try:
        exchange.first_byte_ns = time.time_ns()
        # What is in hand now goes with the head, in one write; with nothing in hand the head
        # goes alone, at once.
        first = peeked + await upstream.read() if upstream.in_hand else peeked
        if first and observe is not None:
            first = observe(first)
        transport, chunked = await side.send_head(first)
        first_event = answered(exchange, upstream, with_body=bool(first))
        sink = client_sink(transport, observe, chunked=chunked, first_event=first_event)
        await upstream.relay(sink, drained(services.budget, transport, side.drain))
        await side.end(exchange.scanner.finish() if exchange.scanner is not None else b"")
    except ConnectionResetError:
        # The client left (the server's write, or the sink's): closing upstream (the caller)
        # aborts the engine.
        exchange.outcome = Outcome.CLIENT_DISCONNECTED
        side.cut()
    except UpstreamError as exc:
        # The head is gone already (or held, to go with bytes that will not come): cut the
        # client's connection so a truncated body is never mistaken for a complete one.
        broke_mid_response(exchange, exc)
        side.cut()
    except asyncio.CancelledError:
        exchange.outcome = Outcome.CLIENT_DISCONNECTED
        raise
