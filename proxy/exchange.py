"""The transport facts of one forwarded exchange: what metrics count for every request."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Forwarded"]


@dataclass(frozen=True)
class Forwarded:
    """Transport facts of one forwarded exchange, observed or not (for metrics)."""

    method: str
    path: str
    status: int | None
    outcome: str  # an Observation outcome, or "rejected": answered by the sidecar itself (413, 503)
    started_ns: int
    first_byte_ns: int | None
    finished_ns: int
    # Time the sidecar itself spent: request in → upstream request sent, and
    # upstream response head → client response head (None where not reached).
    before_upstream_s: float | None
    after_upstream_s: float | None
