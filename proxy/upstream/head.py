"""The request head written upstream (one buffer, in aiohttp's own framing rules), and body framing.

The sidecar's client leg used to be aiohttp's ClientSession; the engine sees the same head
it saw then: Host first (from the upstream URL), the client's end-to-end headers in order,
then the framing: the stated Content-Length, else the body's own length, else chunked; a
body-less POST/PUT/PATCH/DELETE says `Content-Length: 0`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from multidict import CIMultiDict

__all__ = ["Body", "Pieces", "body_size", "chunk_pieces", "framed", "pieces_size", "request_head"]

# A body already in memory is sent whole (bytes) or as pieces of one buffer (a large
# observed body with the injection spliced in); both can be sent twice. A stream of the
# client's own body cannot.
Pieces = tuple[bytes | bytearray | memoryview, ...]
Body = bytes | Pieces | AsyncIterator[bytes | bytearray] | None

# Methods aiohttp sends without a Content-Length when they carry no body.
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


def framed(chunk: bytes, *, chunked: bool) -> bytes:
    """One piece of a body as it goes on the wire: an HTTP/1.1 chunk when the body is chunked."""
    return b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk


def chunk_pieces(chunk: bytes | bytearray) -> tuple[bytes, bytes | bytearray, bytes]:
    """`framed(chunk, chunked=True)` as three pieces for one `writelines`: the chunk itself is
    not copied into the frame (a large one, such as the start of a body read so far)."""
    return b"%x\r\n" % len(chunk), chunk, b"\r\n"


def body_size(body: Body) -> int | None:
    """The body's length in bytes, None for a stream."""
    if body is None:
        return 0
    if isinstance(body, bytes):
        return len(body)
    if isinstance(body, tuple):
        return pieces_size(body)
    return None


def pieces_size(pieces: Pieces) -> int:
    """The length in bytes of a body in pieces."""
    return sum(memoryview(piece).nbytes for piece in pieces)


def request_head(
    method: str, target: str, host: str, headers: CIMultiDict[str], body: Body
) -> tuple[bytes, bool]:
    """The head's bytes, and whether the body goes chunked."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
    lines += [f"{name}: {value}\r\n" for name, value in headers.items()]  # no generator resumed per header
    chunked = False
    if "Content-Length" not in headers:
        size = body_size(body)
        if size is None:
            lines.append("Transfer-Encoding: chunked\r\n")
            chunked = True
        elif body is not None or method not in _BODILESS:
            lines.append(f"Content-Length: {size}\r\n")
    lines.append("\r\n")
    # surrogateescape: a belt for bytes that are not UTF-8. None reach here today: aiohttp refuses
    # them in names and paths, the sidecar answers 400 `invalid_header_encoding` for a value, and
    # the id headers are percent-escaped (the mutation audit's up-head-escape, issue 45).
    return "".join(lines).encode("utf-8", "surrogateescape"), chunked
