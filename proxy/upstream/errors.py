"""How the upstream leg fails: what forward maps to 502 and 504."""

from __future__ import annotations

__all__ = ["UpstreamBadResponse", "UpstreamBroke", "UpstreamError", "UpstreamTimeout", "UpstreamUnreachable"]


class UpstreamError(Exception):
    """The engine could not be asked, or its response could not be read whole."""


class UpstreamUnreachable(UpstreamError):
    """No connection: the engine refused it or its address cannot be reached (502)."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """Connecting took past connect_timeout, or the engine was silent past read_timeout (504)."""


class UpstreamBroke(UpstreamError):
    """The connection closed before the response ended (502).

    `unsent`: the request was not written at all (the pooled connection was found closed
    first), so it may go on another connection. Once written, it never is: the engine may
    have read it, and a second copy would be a second request.
    """

    def __init__(self, message: str, *, unsent: bool = False) -> None:
        super().__init__(message)
        self.unsent = unsent


class UpstreamBadResponse(UpstreamBroke):
    """The engine's response is not HTTP the sidecar relays: not HTTP at all, a head past the
    leg's limits (`max_upstream_head_bytes`, 100 headers), or a reason phrase or header value
    that cannot be relayed unchanged (502 `upstream_bad_answer`; the connection is closed)."""
