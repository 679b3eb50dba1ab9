"""Where the sidecar leans on aiohttp's internals, all of it: the bytes of a response head.

The front writes the bytes aiohttp would write for the same response: the head is built by the
rules of aiohttp's StreamResponse (framing, Content-Type, Date, Server, Connection) and
serialized by aiohttp's own header serializer, so a client cannot tell which server took its
request. On aiohttp, the relay holds a response's head until its first body bytes, to go out
in one write. Both use names aiohttp does not promise to keep (`_serialize_headers`,
`aiohttp.helpers`, `StreamResponse._send_headers_immediately` and the `send_headers` it makes the writer wait for):
tests/test_wire.py fails when an upgrade changes one.
"""

from __future__ import annotations

from http import HTTPStatus

from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.helpers import must_be_empty_body, rfc822_formatted_time, should_remove_content_length
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.http_writer import _serialize_headers
from multidict import CIMultiDict

__all__ = ["HeldHeadResponse", "response_head", "send_held_head", "sidecar_response"]


class HeldHeadResponse(web.StreamResponse):
    """A StreamResponse whose head waits for the first body bytes, to go out in the same write.

    aiohttp writes a StreamResponse's head on its own at prepare(); held, a small response goes
    to the client in one write instead of two (strace: 3 → 2 writes per small request, one
    packet and one wake-up of the client fewer; the sidecar's CPU per request moved within the
    bench's noise, issue 19). `send_held_head` sends the head at once whenever no body is in
    hand, so a client still sees the head when the engine sent it, not when the first event comes.
    """

    _send_headers_immediately = False


async def send_held_head(response: HeldHeadResponse, writer: AbstractStreamWriter, first: bytes) -> None:
    """The held head with `first` in one write; the head alone, at once, when `first` is empty."""
    if first:
        await response.write(first)
    else:
        writer.send_headers()


def response_head(
    method: str, status: int, reason: str, headers: CIMultiDict[str], *, keep_alive: bool
) -> tuple[bytes, bool]:
    """The head aiohttp's StreamResponse writes for this response to an HTTP/1.1 request, and whether it is chunked.

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


def sidecar_response(method: str, response: web.Response, *, keep_alive: bool) -> bytes:
    """The bytes of one of the sidecar's own responses (a JSON error: its body in hand)."""
    body = response.body
    assert isinstance(body, bytes), "the sidecar's own responses carry their body as bytes"
    headers = CIMultiDict(response.headers)
    headers[hdrs.CONTENT_LENGTH] = str(len(body))
    reason = response.reason or HTTPStatus(response.status).phrase
    head, _ = response_head(method, response.status, reason, headers, keep_alive=keep_alive)
    return head if must_be_empty_body(method, response.status) else head + body
