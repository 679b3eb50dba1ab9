"""The answer to a request the front serves, written straight to the client's transport.

The bytes are those aiohttp would write for the same answer: the head is built by the rules of
aiohttp's StreamResponse (framing, Content-Type, Date, Server, Connection) and serialized by
aiohttp's own header serializer, so a client cannot tell which server took its request.
"""

from __future__ import annotations

import asyncio
import time
from http import HTTPStatus

from aiohttp import hdrs, web
from aiohttp.helpers import must_be_empty_body, rfc822_formatted_time, should_remove_content_length
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.http_writer import _serialize_headers
from multidict import CIMultiDict

from proxy.body_budget import BodyBudget
from proxy.config import SETTINGS
from proxy.forward.exchange import Exchange
from proxy.forward.relay import answer_headers, answered, broke_mid_response, client_sink, drained
from proxy.upstream import UpstreamError, UpstreamResponse
from proxy.upstream.head import framed
from proxy.vocabulary import Outcome

__all__ = ["ClientWriter", "relay_answer", "response_head", "sidecar_answer"]


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


def response_head(
    method: str, status: int, reason: str, headers: CIMultiDict[str], *, keep_alive: bool
) -> tuple[bytes, bool]:
    """The head aiohttp's StreamResponse writes for this answer to an HTTP/1.1 request, and whether it is chunked.

    `headers` is completed in place as aiohttp completes a response's: chunked framing when no
    length is known, the octet-stream default type, Date, Server and Connection.
    """
    chunked = False
    if must_be_empty_body(method, status):
        if hdrs.CONTENT_LENGTH in headers and should_remove_content_length(method, status):
            del headers[hdrs.CONTENT_LENGTH]
        headers.popall(hdrs.TRANSFER_ENCODING, None)
    else:
        length = headers.get(hdrs.CONTENT_LENGTH)
        if length is None:
            chunked = True
            headers[hdrs.TRANSFER_ENCODING] = "chunked"
        if length != "0":
            headers.setdefault(hdrs.CONTENT_TYPE, "application/octet-stream")
    if hdrs.DATE not in headers:
        headers[hdrs.DATE] = rfc822_formatted_time()
    headers.setdefault(hdrs.SERVER, SERVER_SOFTWARE)
    if hdrs.CONNECTION not in headers and not keep_alive:
        headers[hdrs.CONNECTION] = "close"
    return _serialize_headers(f"HTTP/1.1 {status} {reason}", headers), chunked


def sidecar_answer(method: str, response: web.Response, *, keep_alive: bool) -> bytes:
    """The bytes of one of the sidecar's own answers (a JSON error: its body in hand)."""
    body = response.body
    assert isinstance(body, bytes), "the sidecar's own answers carry their body as bytes"
    headers = CIMultiDict(response.headers)
    headers[hdrs.CONTENT_LENGTH] = str(len(body))
    reason = response.reason or HTTPStatus(response.status).phrase
    head, _ = response_head(method, response.status, reason, headers, keep_alive=keep_alive)
    return head if must_be_empty_body(method, response.status) else head + body


async def relay_answer(
    app: web.Application,
    writer: ClientWriter,
    upstream: UpstreamResponse,
    exchange: Exchange,
    peeked: bytes,
    *,
    budget: BodyBudget,
    keep_alive: bool,
) -> None:
    """Stream the engine's answer to the client as it arrives, as proxy/forward/relay.py does on aiohttp."""
    headers: CIMultiDict[str] = CIMultiDict()
    observe = answer_headers(upstream, exchange, headers, app[SETTINGS])
    transport = writer.transport
    try:
        head, chunked = response_head(
            "POST", upstream.status, upstream.reason, headers, keep_alive=keep_alive
        )
        exchange.first_byte_ns = time.time_ns()
        # What is in hand now goes with the head, in one write; with nothing in hand the head alone, at once.
        first = peeked + await upstream.read() if upstream.in_hand else peeked
        if first and observe is not None:
            first = observe(first)
        if transport.is_closing():
            raise ConnectionResetError("the client closed its connection")
        transport.write(head + framed(first, chunked=chunked) if first else head)
        first_event = answered(exchange, upstream, with_body=bool(first))
        await upstream.relay(
            client_sink(transport, observe, chunked=chunked, first_event=first_event),
            drained(budget, transport, writer.drain),
        )
        tail = exchange.scanner.finish() if exchange.scanner is not None else b""
        if transport.is_closing():
            raise ConnectionResetError("the client closed its connection")
        if tail:
            transport.write(framed(tail, chunked=chunked))
        if chunked:
            transport.write(b"0\r\n\r\n")
    except ConnectionResetError:
        # The client left: closing upstream (the caller) aborts the engine.
        exchange.outcome = Outcome.CLIENT_DISCONNECTED
        transport.abort()
    except UpstreamError as exc:
        broke_mid_response(exchange, exc)
        # The head is gone already: cut the client's connection so a truncated body is never
        # mistaken for a complete one.
        transport.abort()
    except asyncio.CancelledError:
        exchange.outcome = Outcome.CLIENT_DISCONNECTED
        raise
