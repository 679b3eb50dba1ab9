"""A client request's head as the front reads it: parsed by httptools, and whether the front may serve it.

The front serves plain requests only, and says of every other one why not; aiohttp then
serves it and every later request of its connection, from the request's first byte. So a
head the front declines costs nothing but the parse: aiohttp answers it as it always did
(its own 400 for a head that is not HTTP, 413, 417, the route policy's answers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.forward.ids import ID_HEADERS, is_utf8

__all__ = ["MAX_HEAD_BYTES", "RequestHead", "head_end", "parse_head"]

# aiohttp's own limits are 8,190 bytes a line and a field; a head past this is aiohttp's to refuse.
MAX_HEAD_BYTES = 32 * 1024
_END = b"\r\n\r\n"
# A target the front takes: origin-form, no query, no escape, no dot segment, no empty segment.
# Anything else has spellings engines read differently (proxy/admin/policy.py): aiohttp and the
# route policy judge it.
_PLAIN_TARGET = re.compile(r"/(?:[A-Za-z0-9_~-][A-Za-z0-9._~-]*/?)*")
# Headers whose request the front leaves to aiohttp: a body framed otherwise than by its length,
# an interim answer to send, a protocol switch.
_DECLINED_HEADERS = frozenset({"transfer-encoding", "expect", "upgrade"})


@dataclass(frozen=True, slots=True)
class RequestHead:
    """A plain request's head: what the front needs to serve it (as a web.Request would show it)."""

    method: str
    path: str  # the target, which for a plain head is its path, as sent and as decoded
    headers: CIMultiDictProxy[str]
    content_length: int
    keep_alive: bool
    size: int  # the head's bytes on the wire, its final CRLF included

    @property
    def raw_path(self) -> str:
        return self.path


class _Collector:
    """httptools' callbacks: the target and the headers, as aiohttp decodes them."""

    __slots__ = ("complete", "headers", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # As aiohttp's parser: names are tokens (ASCII), values UTF-8 with surrogateescape.
        self.headers.add(name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))

    def on_headers_complete(self) -> None:
        self.complete = True


def head_end(buffer: bytes | bytearray, start: int) -> int:
    """Where the head that begins at `start` ends (the index after its final CRLF), or -1."""
    at = buffer.find(_END, start)
    return -1 if at < 0 else at + len(_END)


def parse_head(raw: bytes) -> RequestHead | None:
    """The head in `raw` (ending with its blank line) when the front may serve it, else None.

    Served: HTTP/1.1, a target of plain path characters, one Content-Length (a length, not
    chunks), no Expect, Upgrade or Transfer-Encoding, every header value UTF-8.
    """
    collector = _Collector()
    parser = httptools.HttpRequestParser(collector)
    try:
        parser.feed_data(raw)
    except httptools.HttpParserError:
        return None  # aiohttp answers a head that is not HTTP its own way
    if not collector.complete or parser.get_http_version() != "1.1":
        return None
    target = collector.url.decode("latin-1")
    if _PLAIN_TARGET.fullmatch(target) is None:
        return None
    headers = collector.headers
    lengths = headers.getall("Content-Length", ())
    if len(lengths) != 1 or not lengths[0].isdigit() or not lengths[0].isascii():
        return None
    for name, value in headers.items():
        lowered = name.lower()
        if lowered in _DECLINED_HEADERS or (lowered not in ID_HEADERS and not is_utf8(value)):
            return None
    return RequestHead(
        method=parser.get_method().decode("latin-1"),
        path=target,
        headers=CIMultiDictProxy(headers),
        content_length=int(lengths[0]),
        keep_alive=parser.should_keep_alive(),
        size=len(raw),
    )
