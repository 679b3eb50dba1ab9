"""What the connection guard writes on a connection it closes itself: the 503s of the connection caps, the 408."""

from __future__ import annotations

import orjson

__all__ = ["HEAD_TIMEOUT_ANSWER", "PEER_REFUSAL", "REFUSAL", "REFUSAL_BODY"]

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
HEAD_TIMEOUT_ANSWER = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
