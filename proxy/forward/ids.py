"""The ids a client tags a request with (X-Session-Id, X-Case-Id, X-Request-Id), made safe to record.

aiohttp decodes header bytes as UTF-8 with `surrogateescape`, so a value that is not UTF-8
arrives as a str that no JSON encoder accepts: the record carrying it would be lost. An id
is therefore stored percent-encoded wherever it leaves the id charset `[A-Za-z0-9._:-]`:
`%XX` for each other byte (controls, spaces, non-ASCII, invalid UTF-8, `%` itself). A valid
id is stored as sent; a `%` in a stored id means it was escaped, and the original bytes are
recoverable (`urllib.parse.unquote_to_bytes`). Every stored id is cut at ID_CHARS characters:
a client's 8 KB X-Request-Id would otherwise make each record of a refused request ~8 KB, and a
flood of them rotate the evidence away (docs/security.md).
"""

from __future__ import annotations

import os
import re
import string

__all__ = [
    "ID_CHARS",
    "ID_HEADERS",
    "SESSION_ID_CHARS",
    "forwardable",
    "is_stored_id",
    "is_utf8",
    "new_request_id",
    "stored_id",
]

ID_HEADERS = frozenset({"x-session-id", "x-case-id", "x-request-id"})
# Every id a client sends is bounded so a client cannot bloat the evidence.
ID_CHARS = 128
SESSION_ID_CHARS = ID_CHARS
_SAFE = frozenset((string.ascii_letters + string.digits + "._:-").encode("ascii"))
_STORED = re.compile(r"(?:[A-Za-z0-9._:-]|%[0-9A-F]{2}){1,128}")


class _RandomIds:
    """Request ids of 32 random hex digits, as uuid4().hex gave, cut from one urandom read of 256.

    One getrandom(2) per 256 requests instead of one per request (issue 34: each system call
    counts at a paced load); the bytes are the kernel's CSPRNG's as before.
    """

    __slots__ = ("_hex", "_next")
    _IDS = 256

    def __init__(self) -> None:
        self._hex, self._next = "", self._IDS

    def __call__(self) -> str:
        at = self._next
        if at == self._IDS:
            self._hex, at = os.urandom(16 * self._IDS).hex(), 0
        self._next = at + 1
        return self._hex[32 * at : 32 * at + 32]


new_request_id = _RandomIds()


def _bytes(value: str) -> bytes:
    """The header's bytes as they came off the wire."""
    return value.encode("utf-8", "surrogateescape")


def stored_id(value: str | None, limit: int | None = ID_CHARS) -> str | None:
    """`value` as the evidence stores it: escaped outside the id charset, cut to `limit` characters.

    The cut never splits an escape.
    """
    if not value:
        return None
    raw = _bytes(value)
    if all(byte in _SAFE for byte in raw):
        return value[:limit]
    pieces: list[str] = []
    size = 0
    for byte in raw:
        piece = chr(byte) if byte in _SAFE else f"%{byte:02X}"
        if limit is not None and size + len(piece) > limit:
            break
        pieces.append(piece)
        size += len(piece)
    return "".join(pieces)


def is_stored_id(value: str) -> bool:
    """Whether `value` is a session/case id as the evidence may hold it (escapes included)."""
    return _STORED.fullmatch(value) is not None and len(value) <= SESSION_ID_CHARS


def is_utf8(value: str) -> bool:
    """Whether a decoded header value came as valid UTF-8 (so it can be sent on unchanged)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def forwardable(value: str) -> str:
    """An id header's value as sent upstream: unchanged, unless its bytes are not UTF-8.

    aiohttp's client can only send header values as UTF-8 (its C writer silently drops
    the undecodable bytes), so such an id goes on in the escaped form the evidence holds.
    """
    return value if is_utf8(value) else stored_id(value, limit=None) or ""
