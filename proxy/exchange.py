"""The transport facts of one forwarded exchange: what metrics count for every request."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Forwarded", "Outcome"]


class Outcome(StrEnum):
    """How a forwarded exchange ended (the `outcome` of observations and of the request metrics)."""

    OK = "ok"  # the engine's answer reached the client whole
    CLIENT_DISCONNECTED = "client_disconnected"
    CLIENT_STALLED = "client_stalled"  # cut by client_write_timeout: it stopped reading the answer
    UPSTREAM_ERROR = "upstream_error"
    TIMEOUT = "timeout"
    REJECTED = "rejected"  # answered by the sidecar itself (400, 413, 503), never by the engine


@dataclass(frozen=True, slots=True)
class Forwarded:
    """Transport facts of one forwarded exchange, observed or not (for metrics)."""

    method: str
    path: str
    status: int | None
    outcome: Outcome
    started_ns: int
    first_byte_ns: int | None
    finished_ns: int
    # Time the sidecar itself spent: request in → upstream request sent, and
    # upstream response head → client response head (None where not reached).
    before_upstream_s: float | None
    after_upstream_s: float | None
    bad_answer: bool = False  # the engine's answer broke HTTP or the leg's limits (502 upstream_bad_answer)
