"""How the upstream leg fails: what forward maps to 502 and 504."""

from __future__ import annotations

__all__ = ["UpstreamBroke", "UpstreamError", "UpstreamTimeout", "UpstreamUnreachable"]


class UpstreamError(Exception):
    """The engine could not be asked, or its answer could not be read whole."""


class UpstreamUnreachable(UpstreamError):
    """No connection: the engine refused it or its address cannot be reached (502)."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """Connecting took past connect_timeout, or the engine was silent past read_timeout (504)."""


class UpstreamBroke(UpstreamError):
    """The connection closed, or carried bytes that are not HTTP, before the answer ended (502).

    `before_answer`: not one byte of the answer had arrived, the mark of a pooled connection
    the engine closed just as it was reused (the request may then be sent again).
    """

    def __init__(self, message: str, *, before_answer: bool) -> None:
        super().__init__(message)
        self.before_answer = before_answer
