"""The client-connection limits as words, what the guard writes on a connection it closes itself
(the 503s of the connection caps, the 408), and the send queue a slow reader leaves behind
(proxy/inbound/guard.py enforces the limits, deadline.py checks them)."""

from __future__ import annotations

import asyncio
import fcntl
import sys
import termios
from enum import StrEnum

import orjson
from aiohttp import web

__all__ = [
    "CLIENT_STALLED",
    "HEAD_TIMEOUT_RESPONSE",
    "PEER_REFUSAL",
    "REFUSAL",
    "REFUSAL_BODY",
    "Limit",
    "Phase",
    "unsent",
]

# SIOCOUTQ (Linux's TIOCOUTQ on a socket): bytes in the send queue the peer has not acknowledged.
_OUTQ: int | None = getattr(termios, "TIOCOUTQ", None) if sys.platform == "linux" else None

REFUSAL_BODY = orjson.dumps(
    {
        "error": {
            "message": "the sidecar has max_connections client connections open; retry shortly",
            "type": "service_unavailable",
            "code": "too_many_connections",
        }
    }
)
_PEER_REFUSAL_BODY = orjson.dumps(
    {
        "error": {
            "message": "the sidecar has max_connections_per_peer connections open from this address; retry shortly",
            "type": "service_unavailable",
            "code": "too_many_connections",
        }
    }
)


def _refusal(body: bytes) -> bytes:
    """A 503 with `body`, written on the transport as the connection closes."""
    return (
        b"HTTP/1.1 503 Service Unavailable\r\n"
        b"Content-Type: application/json\r\n"
        b"Retry-After: 1\r\n"
        b"Connection: close\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


REFUSAL = _refusal(REFUSAL_BODY)
PEER_REFUSAL = _refusal(_PEER_REFUSAL_BODY)
HEAD_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"

# Set on a request whose client was cut by client_write_timeout.
CLIENT_STALLED = web.RequestKey("client_stalled", bool)


class Limit(StrEnum):
    """The connection limits, as metric labels and log words."""

    HEADER_TIMEOUT = "header_timeout"
    BODY_IDLE_TIMEOUT = "body_idle_timeout"
    BODY_TIMEOUT = "body_timeout"
    CLIENT_WRITE_TIMEOUT = "client_write_timeout"
    MAX_CONNECTIONS = "max_connections"
    MAX_CONNECTIONS_PER_PEER = "max_connections_per_peer"


class Phase(StrEnum):
    """Where a connection is in its request cycle."""

    HEAD = "head"  # waiting for (the rest of) a request head: header_timeout runs
    REQUEST = "request"  # a request runs: body_idle_timeout runs while the body is unread
    IDLE = "idle"  # keep-alive between requests: aiohttp's keepalive_timeout, or the front's


def unsent(transport: asyncio.Transport) -> int:
    """Bytes written to the client that it has not taken: the transport's buffer and the kernel's send queue.

    The transport's buffer alone moves in steps of half the kernel's send buffer (a few MiB on
    Linux): a client that reads 10 KiB/s would seem to take nothing for minutes.
    """
    size = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if _OUTQ is not None and sock is not None:
        try:
            queued = fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0")
        except OSError:
            return size
        size += int.from_bytes(queued, sys.byteorder, signed=True)
    return size
