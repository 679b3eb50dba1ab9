"""A client request's head as httptools reads it, with the facts that decide which server takes it.

Reading judges nothing: proxy/inbound/choice.py does, from these facts. A head httptools cannot
read is None, and aiohttp answers it its own way (its 400 for a head that is not HTTP).
"""

from __future__ import annotations

from typing import NamedTuple

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.forward.ids import ID_HEADERS

__all__ = ["MAX_FIELD", "MAX_HEADERS", "RequestHead", "parse_head"]

# aiohttp's own limits: 8,190 bytes a line and a field, 128 headers. A head past any of them is
# aiohttp's to refuse (issue 45: a complete 109 KB head with 12,000 headers was served).
MAX_FIELD = 8190
MAX_HEADERS = 128

# Headers whose request the front leaves to aiohttp: a body framed otherwise than by its length,
# an interim response to send, a protocol switch.
_DECLINED_HEADERS = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
_ID_HEADERS = frozenset(name.encode() for name in ID_HEADERS)


class RequestHead(NamedTuple):
    """A request's head: what the front needs to serve it (as a web.Request would show it), and
    what choice.py reads to say whether it may.

    A NamedTuple, frozen as a dataclass would be, built in a fraction of the time (issue 34: it is
    made for every request).
    """

    method: str
    path: str  # the target as sent, which for a head the front takes is its path, decoded too
    headers: CIMultiDictProxy[str]
    content_length: int | None  # None: no Content-Length, or one that is no length
    keep_alive: bool
    size: int  # the head's bytes on the wire, its final CRLF included
    version: str
    lengths: int  # how many Content-Length headers it has
    declined_header: str | None  # the first of Transfer-Encoding, Expect, Upgrade it has
    utf8: bool  # every header value is UTF-8 (the id headers excepted: stored escaped, forward/ids.py)
    hosts: int  # how many Host headers (an HTTP/1.1 request has one)
    within_limits: bool  # aiohttp's: the target, each header and their count

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


def parse_head(raw: bytes) -> RequestHead | None:
    """The head in `raw` (ending with its blank line), or None when httptools cannot read it."""
    collector = _Collector()
    parser = httptools.HttpRequestParser(collector)
    try:
        parser.feed_data(raw)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        # aiohttp answers a head that is not HTTP its own way, and an Upgrade or CONNECT as it
        # did (HttpParserUpgrade is no HttpParserError: uncaught, it left data_received).
        return None
    if not collector.complete:
        return None
    length: int | None = None
    lengths, hosts, declined, utf8 = 0, 0, None, True
    within = len(collector.headers) <= MAX_HEADERS and len(collector.url) <= MAX_FIELD
    # No field of a head this short can pass the limit: two len() a header saved.
    fields_fit = len(raw) <= MAX_FIELD
    pairs: list[tuple[str, str]] = []
    for name, value in collector.headers:
        lowered = name.lower()
        if not fields_fit and (len(value) > MAX_FIELD or len(name) > MAX_FIELD):
            within = False
        if lowered == b"host":
            hosts += 1
        elif lowered == b"content-length":
            lengths += 1
            length = int(value) if value.isdigit() else None
        elif lowered in _DECLINED_HEADERS and declined is None:
            declined = lowered.decode("latin-1")
        if utf8 and not value.isascii() and lowered not in _ID_HEADERS and not _utf8(value):
            utf8 = False
        # As aiohttp's parser decodes them: names are tokens (ASCII), values UTF-8 with surrogateescape.
        pairs.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))
    return RequestHead(
        parser.get_method().decode("latin-1"),
        collector.url.decode("latin-1"),
        CIMultiDictProxy(CIMultiDict(pairs)),
        length,
        parser.should_keep_alive(),
        len(raw),
        parser.get_http_version(),
        lengths,
        declined,
        utf8,
        hosts,
        within,
    )


def _utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
