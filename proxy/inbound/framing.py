"""Where one connection's requests begin and end, read from its bytes alone: sans-IO, as h11's readers.

Bytes go in (`feed`); `next_event` says what they hold: a request head, the whole request, or
that more bytes are needed. The owner decides what a head is worth (proxy/inbound/choice.py):
`take` frames its body here, exactly the bytes its Content-Length names, each piece admitted
by the owner's hook as it arrives (the body budget: `BODY_REFUSED` when it says no); `decline`
gives back every byte from that head's first on, for the other server. A connection's framing
is decided once, so two parsers never disagree on where a request ends.

A read that begins a request (nothing kept before it) is framed where it lies: the head is
sliced out, the body's bytes are viewed, not copied, until they join the body buffer (a 220 KB
prompt arrives in one or two reads, and is copied once).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import NamedTuple

__all__ = ["BODY_REFUSED", "HEAD_TOO_LARGE", "MAX_HEAD_BYTES", "NEED_DATA", "Framer", "Head", "Request"]

# aiohttp's own limits are 8,190 bytes a line and a field; a head past this is aiohttp's to refuse.
MAX_HEAD_BYTES = 32 * 1024
_END = b"\r\n\r\n"


class Signal(Enum):
    """What the bytes fed hold when it is neither a head nor a request."""

    NEED_DATA = "need data"  # nothing complete: feed more
    HEAD_TOO_LARGE = "head too large"  # no head end within MAX_HEAD_BYTES: `decline` it
    BODY_REFUSED = "body refused"  # the owner's hook refused a piece of the body: `decline` it


NEED_DATA = Signal.NEED_DATA
HEAD_TOO_LARGE = Signal.HEAD_TOO_LARGE
BODY_REFUSED = Signal.BODY_REFUSED


class Head(NamedTuple):
    """A complete head, its final CRLF included: `take` or `decline` it before the next event."""

    raw: bytes


class Request(NamedTuple):
    """The taken head's whole body; the framer is at the next head (`next_event` when ready for it)."""

    body: bytearray


Event = Signal | Head | Request
# Whether `size` more bytes of the body may be kept (the owner's body budget).
Admit = Callable[[int], bool]


class _State(Enum):
    HEAD = "head"  # before a head, or within one
    DECIDING = "deciding"  # a head is out: take or decline
    BODY = "body"  # a taken head's body
    DONE = "done"  # declined: every byte was given back


class Framer:
    """Frames one connection's requests: a head, then exactly the body its owner took."""

    # One per open connection: slots keep 1,000 open streams' worth small.
    __slots__ = ("_admit", "_at", "_body", "_data", "_head", "_need", "_state")

    def __init__(self) -> None:
        self._data: bytes | bytearray = b""  # what was fed and is not framed yet, from `_at` on
        self._at = 0
        self._state = _State.HEAD
        self._head = b""  # the head out or taken, as it came (declined: it goes first)
        self._body = bytearray()  # the taken head's body so far
        self._need = 0  # its bytes still to come
        self._admit: Admit | None = None

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
            return self._body_event()
        if self._state is not _State.HEAD:
            raise RuntimeError(f"next_event while {self._state.value}")
        data, at = self._data, self._at
        end = data.find(_END, at)
        if end < 0:
            if len(data) - at > MAX_HEAD_BYTES:
                return HEAD_TOO_LARGE
            self._keep_rest()
            return NEED_DATA
        end += len(_END)
        self._head, self._at, self._state = bytes(data[at:end]), end, _State.DECIDING
        return Head(self._head)

    def take(self, content_length: int, admit: Admit) -> None:
        """The head just out is served here: its body is the next `content_length` bytes, each
        piece kept only once `admit(size)` said yes."""
        if self._state is not _State.DECIDING:
            raise RuntimeError(f"take while {self._state.value}")
        self._state, self._need, self._admit = _State.BODY, content_length, admit

    def decline(self) -> tuple[bytes | bytearray, ...]:
        """The request is not served here: every byte from its head's first on, in order (in
        pieces: a body is not joined). The framer is done; the connection is the other server's."""
        rest = self._data[self._at :]
        if self._state is _State.BODY:
            pieces: tuple[bytes | bytearray, ...] = (self._head, self._body, rest)
        else:  # the bytes as they came, in one piece: the other server frames them as one read
            pieces = (self._head + rest,)
        self._state, self._data, self._at, self._admit = _State.DONE, b"", 0, None
        self._head, self._body = b"", bytearray()
        return tuple(piece for piece in pieces if piece)

    def _body_event(self) -> Event:
        """Keep what is in hand of the body, as far as the hook admits it; the request once whole."""
        need = self._need
        if need:
            data, at = self._data, self._at
            size = min(len(data) - at, need)
            if size == 0:
                return NEED_DATA
            assert self._admit is not None
            if not self._admit(size):
                return BODY_REFUSED
            with memoryview(data) as view:  # sliced, not copied, until it joins the body
                self._body += view[at : at + size]
            self._at, self._need = at + size, need - size
            if need > size:
                return NEED_DATA
        body, self._body = self._body, bytearray()
        self._head, self._state, self._admit = b"", _State.HEAD, None
        self._keep_rest()
        return Request(body)

    def _keep_rest(self) -> None:
        """Copy what is left of a read into a buffer of its own, so the read itself is freed."""
        data, at = self._data, self._at
        if at >= len(data):
            self._data, self._at = b"", 0
        elif at and not isinstance(data, bytearray):
            self._data, self._at = bytearray(memoryview(data)[at:]), 0
