"""Where one connection's requests begin and end, read from its bytes alone: sans-IO, as h11's readers.

Bytes go in (`feed`); `next_event` says what they hold: a request head, a piece of the body of
the head its owner took, the whole request, or that more bytes are needed. The owner decides
what a head is worth (proxy/inbound/choice.py): `take` frames its body here, exactly the bytes
its Content-Length names; `decline` gives back every byte from that head's first on, for the
other server. A connection's framing is decided once, so two parsers never disagree on where a
request ends.

A read that begins a request (nothing kept before it) is framed where it lies: the head is
sliced out, the body's bytes are viewed, not copied, until they join the body buffer (a 220 KB
prompt arrives in one or two reads, and is copied once).
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

__all__ = ["MAX_HEAD_BYTES", "NEED_DATA", "Framer", "Head", "HeadTooLarge", "Piece", "Request"]

# aiohttp's own limits are 8,190 bytes a line and a field; a head past this is aiohttp's to refuse.
MAX_HEAD_BYTES = 32 * 1024
_END = b"\r\n\r\n"


class _Need(Enum):
    NEED_DATA = "need data"


NEED_DATA = _Need.NEED_DATA  # nothing complete in what was fed: feed more


class HeadTooLarge(NamedTuple):
    """No head ends within MAX_HEAD_BYTES: its bytes are the other server's to refuse (`decline`)."""

    size: int


class Head(NamedTuple):
    """A complete head, its final CRLF included: `take` or `decline` it before the next event."""

    raw: bytes


class Piece(NamedTuple):
    """Bytes of the taken head's body: `keep` them, or `decline` the request with them."""

    data: bytes | memoryview


class Request(NamedTuple):
    """The taken head's whole body; the framer is at the next head (`next_event` when ready for it)."""

    body: bytearray


Event = _Need | HeadTooLarge | Head | Piece | Request


class _State(Enum):
    HEAD = "head"  # before a head, or within one
    DECIDING = "deciding"  # a head is out: take or decline
    BODY = "body"  # a taken head's body
    DONE = "done"  # declined: every byte was given back


class Framer:
    """Frames one connection's requests: a head, then exactly the body its owner took."""

    # One per open connection: slots keep 1,000 open streams' worth small.
    __slots__ = ("_at", "_body", "_data", "_head", "_need", "_state")

    def __init__(self) -> None:
        self._data: bytes | bytearray = b""  # what was fed and is not framed yet, from `_at` on
        self._at = 0
        self._state = _State.HEAD
        self._head = b""  # the head out or taken, as it came (declined: it goes first)
        self._body = bytearray()  # the taken head's body so far
        self._need = 0  # its bytes still to come

    @property
    def buffered(self) -> int:
        """Bytes fed and not framed yet (a later request's, while one is served)."""
        return len(self._data) - self._at

    def feed(self, data: bytes) -> None:
        """Bytes as they came from the client."""
        if self._at >= len(self._data):  # nothing kept: frame `data` where it lies
            self._data, self._at = data, 0
            return
        if not isinstance(self._data, bytearray):
            self._data = bytearray(memoryview(self._data)[self._at :])
            self._at = 0
        self._data += data

    def next_event(self) -> Event:
        """What the bytes fed hold next."""
        if self._state is _State.BODY:
            return self._piece()
        if self._state is not _State.HEAD:
            raise RuntimeError(f"next_event while {self._state.value}")
        data, at = self._data, self._at
        end = data.find(_END, at)
        if end < 0:
            if len(data) - at > MAX_HEAD_BYTES:
                return HeadTooLarge(len(data) - at)
            self._keep_rest()
            return NEED_DATA
        end += len(_END)
        self._head, self._at, self._state = bytes(data[at:end]), end, _State.DECIDING
        return Head(self._head)

    def take(self, content_length: int) -> None:
        """The head just out is served here: its body is the next `content_length` bytes."""
        self._expect(_State.DECIDING)
        self._state, self._need = _State.BODY, content_length

    def keep(self, piece: Piece) -> None:
        """The piece just out joins the body."""
        self._expect(_State.BODY)
        size = len(piece.data)
        self._body += piece.data
        self._at += size
        self._need -= size

    def decline(self) -> tuple[bytes | bytearray, ...]:
        """The request is not served here: every byte from its head's first on, in order (in
        pieces: a body is not joined). The framer is done; the connection is the other server's."""
        rest = self._data[self._at :]
        if self._state is _State.BODY:
            pieces: tuple[bytes | bytearray, ...] = (self._head, self._body, rest)
        else:  # the bytes as they came, in one piece: the other server frames them as one read
            pieces = (self._head + rest,)
        self._state, self._data, self._at = _State.DONE, b"", 0
        self._head, self._body = b"", bytearray()
        return tuple(piece for piece in pieces if piece)

    def _piece(self) -> Event:
        if self._need == 0:
            body, self._body = self._body, bytearray()
            self._head, self._state = b"", _State.HEAD
            self._keep_rest()
            return Request(body)
        available = len(self._data) - self._at
        if available == 0:
            return NEED_DATA
        size = min(available, self._need)
        data, at = self._data, self._at
        if isinstance(data, bytearray):  # a view would pin the buffer against the next feed
            return Piece(bytes(data[at : at + size]))
        return Piece(memoryview(data)[at : at + size])

    def _keep_rest(self) -> None:
        """Copy what is left of a read into a buffer of its own, so the read itself is freed."""
        data, at = self._data, self._at
        if at >= len(data):
            self._data, self._at = b"", 0
        elif at and not isinstance(data, bytearray):
            self._data, self._at = bytearray(memoryview(data)[at:]), 0

    def _expect(self, state: _State) -> None:
        if self._state is not state:
            raise RuntimeError(f"framer is {self._state.value}, not {state.value}")
