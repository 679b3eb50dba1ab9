"""Hands each finished observation to the witness, the evidence log and the metrics — one path."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from proxy.keys import EVIDENCE, METRICS, WITNESS
from proxy.observe import Observation

__all__ = ["Forwarded", "begin_observation", "record_forwarded", "record_observation"]


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


def begin_observation(app: web.Application) -> tuple[str | None, int | None]:
    """The reset this request belongs to and its ordinal since that reset."""
    witness = app.get(WITNESS)
    return witness.begin_request() if witness is not None else (None, None)


def record_observation(app: web.Application, observation: Observation) -> None:
    """Record one exchange: never blocks, never raises into the forwarding path."""
    evidence = app.get(EVIDENCE)
    witness = app.get(WITNESS)
    verification = witness.observe(observation) if witness is not None else None
    if evidence is not None:
        evidence.write(observation.to_record())
        if verification is not None:
            evidence.write(verification)
    metrics = app.get(METRICS)
    if metrics is not None:
        metrics.observe(observation, verification)


def record_forwarded(app: web.Application, forwarded: Forwarded) -> None:
    """Count one forwarded exchange in the metrics."""
    metrics = app.get(METRICS)
    if metrics is not None:
        metrics.forwarded(forwarded)
