"""What the leg takes of an engine's response head: bounded in size and count, relayable unchanged.

An engine is trusted with the response's content, not with the sidecar's memory and loop:
httptools grows a header value by concatenation, so an endless one costs time quadratic in
its length (a 100 MB block froze the sidecar for seconds and took ~1 GB, issue 27). The old
ClientSession capped heads at 8,190 bytes; the leg caps them at `max_upstream_head_bytes`
and 100 headers. What the client gets is the engine's head as sent, so a reason phrase or a
header value that cannot go out unchanged (a control byte, bytes that are not UTF-8: aiohttp
writes heads as UTF-8 and refuses control bytes) refuses the response rather than relaying it
altered, the mirror of the 400 a client gets for a request header that is not UTF-8.
"""

from __future__ import annotations

import re

from multidict import CIMultiDict

__all__ = ["DEFAULT_MAX_HEAD_BYTES", "MAX_HEADERS", "HeadRefused", "reason_text", "response_headers"]

DEFAULT_MAX_HEAD_BYTES = 64 * 1024
# Per head, and again for the trailers of a chunked body (never relayed, still parsed).
MAX_HEADERS = 100

# RFC 9112 §4: reason-phrase = 1*( HTAB / SP / VCHAR / obs-text ); llhttp lets any byte but CR/LF by.
_REASON = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")


class HeadRefused(Exception):
    """Raised from a parser callback: the response is refused (the message says why, never a value)."""


def reason_text(raw: bytes) -> str:
    """The reason phrase as the client will get it, or HeadRefused."""
    if not raw.isalnum() and _REASON.fullmatch(raw) is None:  # isalnum: "OK" without the regex
        raise HeadRefused("the engine's reason phrase holds control bytes")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise HeadRefused("the engine's reason phrase is not UTF-8") from None


def response_headers(raw: list[tuple[bytes, bytes]]) -> CIMultiDict[str]:
    """The headers as the client will get them, or HeadRefused naming the first value that is not UTF-8.

    llhttp has already refused control bytes in names and values, and names outside the
    token characters (ASCII).
    """
    try:
        return CIMultiDict([(name.decode(), value.decode()) for name, value in raw])
    except UnicodeDecodeError:
        for name, value in raw:
            try:
                value.decode()
            except UnicodeDecodeError:
                raise HeadRefused(f"the engine's {name.decode()} header value is not UTF-8") from None
        raise
