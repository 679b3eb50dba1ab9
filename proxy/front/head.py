"""A client request's head as the front reads it: parsed by httptools, and whether the front may serve it.

The front serves plain requests only, and says of every other one why not; aiohttp then
serves it and every later request of its connection, from the request's first byte. So a
head the front declines costs nothing but the parse: aiohttp answers it as it always did
(its own 400 for a head that is not HTTP, 413, 417, the route policy's answers).
"""

from __future__ import annotations

from typing import NamedTuple

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.forward.ids import ID_HEADERS

__all__ = ["MAX_HEAD_BYTES", "RequestHead", "head_end", "parse_head", "plain_target"]

# aiohttp's own limits are 8,190 bytes a line and a field, 128 headers; a head past any of
# them, or past this in all, is aiohttp's to refuse (issue 45: a complete 109 KB head with
# 12,000 headers was served).
MAX_HEAD_BYTES = 32 * 1024
_MAX_FIELD = 8190
_MAX_HEADERS = 128
_END = b"\r\n\r\n"
# A target the front takes: origin-form, no query, no escape, no dot segment, no empty segment
# (a trailing slash aside). Anything else has spellings engines read differently
# (proxy/admin/policy.py): aiohttp and the route policy judge it. Checked by a set and two
# substring scans, each linear: a regex with a repeated group of optional parts tried 2^n splits of an
# n-letter segment before refusing a `?` after it (issue 45: 79 bytes held the loop 75 s).
_TARGET_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._~-/")
# Headers whose request the front leaves to aiohttp: a body framed otherwise than by its length,
# an interim answer to send, a protocol switch.
_DECLINED_HEADERS = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
_ID_HEADERS = frozenset(name.encode() for name in ID_HEADERS)


class RequestHead(NamedTuple):
    """A plain request's head: what the front needs to serve it (as a web.Request would show it).

    A NamedTuple, frozen as a dataclass would be, built in a fraction of the time (issue 34: it is
    made for every request).
    """

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
    """httptools' callbacks: the target and the headers as they came (bytes)."""

    __slots__ = ("complete", "headers", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.complete = True


def head_end(buffer: bytes | bytearray, start: int) -> int:
    """Where the head that begins at `start` ends (the index after its final CRLF), or -1."""
    at = buffer.find(_END, start)
    return -1 if at < 0 else at + len(_END)


def parse_head(raw: bytes) -> RequestHead | None:
    """The head in `raw` (ending with its blank line) when the front may serve it, else None.

    Served: HTTP/1.1 within aiohttp's limits and with one Host, a target of plain path
    characters, one Content-Length (a length, not
    chunks), no Expect, Upgrade or Transfer-Encoding, every header value UTF-8 (the id
    headers excepted: they are stored escaped, proxy/forward/ids.py).
    """
    collector = _Collector()
    parser = httptools.HttpRequestParser(collector)
    try:
        parser.feed_data(raw)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        # aiohttp answers a head that is not HTTP its own way, and an Upgrade or CONNECT as it
        # did (HttpParserUpgrade is no HttpParserError: uncaught, it left data_received).
        return None
    if not collector.complete or parser.get_http_version() != "1.1" or not _within_limits(raw, collector):
        return None
    target = collector.url.decode("latin-1")
    if not plain_target(target):
        return None
    length: bytes | None = None
    hosts = 0
    pairs: list[tuple[str, str]] = []
    for name, value in collector.headers:
        lowered = name.lower()
        if len(value) > _MAX_FIELD or len(name) > _MAX_FIELD:
            return None
        if lowered == b"host":
            hosts += 1
        elif lowered == b"content-length":
            if length is not None or not value.isdigit():
                return None  # two lengths, or one that is not a number: aiohttp's to refuse
            length = value
        elif lowered in _DECLINED_HEADERS:
            return None
        if not value.isascii() and lowered not in _ID_HEADERS and not _utf8(value):
            return None
        # As aiohttp's parser decodes them: names are tokens (ASCII), values UTF-8 with surrogateescape.
        pairs.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))
    if length is None or hosts != 1:
        return None
    return RequestHead(
        parser.get_method().decode("latin-1"),
        target,
        CIMultiDictProxy(CIMultiDict(pairs)),
        int(length),
        parser.should_keep_alive(),
        len(raw),
    )


def _within_limits(raw: bytes, collector: _Collector) -> bool:
    """Whether the head keeps aiohttp's limits on the whole, the count and the target (each header's
    size and the one Host an HTTP/1.1 request must have are checked as parse_head reads them)."""
    return (
        len(raw) <= MAX_HEAD_BYTES
        and len(collector.headers) <= _MAX_HEADERS
        and len(collector.url) <= _MAX_FIELD
    )


def plain_target(target: str) -> bool:
    """Whether `target` is a plain path: `/`, then segments of letters, digits and `._~-` that do
    not start with a dot, joined by single slashes, with at most one slash at the end.

    Three scans in C: a character outside the set (`?`, `%`, `;`, `:`...) is refused first.
    """
    return (
        target[:1] == "/" and _TARGET_CHARS.issuperset(target) and "//" not in target and "/." not in target
    )


def _utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
