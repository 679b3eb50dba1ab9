"""What a reset's canary proved, and how the answer and the `infer.cache_state` record say it (docs/reset.md).

A reset the engine acknowledged but the canary contradicts did not clear the cache: its
answer is `contradicted` (HTTP 502, `success: false`, a `hint`). The record keeps the
reference client's shape; its `verified` and `reason` carry the canary's result.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.engines.base import CacheReset
from proxy.vocabulary import ResetAnswer, RunKind, Verified, VerifyMode

__all__ = [
    "Reading",
    "Verification",
    "answer_of",
    "not_run",
    "record_with",
]

# The status of a reset the canary contradicts (its answer is ResetAnswer.CONTRADICTED): the
# engine's answer was proven invalid (RFC 9110 502, "an invalid response from an inbound
# server"). Not 409: benchmark tools retry a 409 as a busy engine (aiperf for 60 s), and a reset
# a witness proved false is not worth retrying.
CONTRADICTED_STATUS = 502


@dataclass(frozen=True)
class Reading:
    """One canary answer's numbers: cached and prompt tokens (None where the engine did not say)."""

    cached: int | None
    prompt: int | None

    def to_json(self) -> dict[str, int | None]:
        """`{cached, prompt}` as in the answer's `verification`."""
        return {"cached": self.cached, "prompt": self.prompt}

    def quoted(self) -> str:
        """`384 of 512` for reasons."""
        return f"{self.cached} of {self.prompt}"


@dataclass(frozen=True)
class Verification:
    """The canary's result for one engine reset (the answer's `verified` and `verification`)."""

    method: VerifyMode
    verified: Verified
    reason: str
    canary_tokens: int | None = None
    before: Reading | None = None
    after: tuple[Reading, ...] = ()
    elapsed_s: float = 0.0
    hint: str | None = None
    # Each witness that ran, by name: its JSON with `result` and its numbers (`canary`, `events`, ...).
    witnesses: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # The canary's probes: cached tokens per tier (vLLM's per-source counter), None without one.
    cached_by_tier: Mapping[str, int] | None = None
    # Each tier's state (proxy/witnesses/tiers.py); None until the reset service judged them.
    tiers: Mapping[str, str] | None = None
    # A multi-rank engine: each data-parallel rank's own canary result (proxy/witnesses/ranks.py).
    ranks: tuple[Mapping[str, Any], ...] = ()

    @property
    def ran(self) -> bool:
        """Whether any witness ran at all."""
        return self.method != VerifyMode.NONE

    def to_json(self) -> dict[str, Any]:
        """The `verification` block of answers and records."""
        body: dict[str, Any] = {
            "method": self.method.value,
            "canary_tokens": self.canary_tokens,
            "before": self.before.to_json() if self.before is not None else None,
            "after": [reading.to_json() for reading in self.after],
            "elapsed_s": round(self.elapsed_s, 6),
            "reason": self.reason,
            "witnesses": {name: dict(report) for name, report in self.witnesses.items()},
            "tiers": dict(self.tiers) if self.tiers is not None else None,
            "probe_cached_by_tier": dict(self.cached_by_tier) if self.cached_by_tier is not None else None,
        }
        if self.ranks:
            body["ranks"] = [dict(rank) for rank in self.ranks]
        return body


def not_run(reason: str) -> Verification:
    """A reset that sent no canary: today's answers, `verified: unverified`."""
    return Verification(VerifyMode.NONE, Verified.UNVERIFIED, reason)


def answer_of(reset: CacheReset, verification: Verification) -> tuple[ResetAnswer, int]:
    """The answer word and HTTP status: the engine's, unless a witness contradicts an accepted reset
    or a rank of a multi-rank engine is unproven."""
    if verification.verified == Verified.CONTRADICTED and reset.succeeded:
        return ResetAnswer.CONTRADICTED, CONTRADICTED_STATUS
    if reset.acknowledged and any(
        rank.get("verified") != Verified.VERIFIED.value for rank in verification.ranks
    ):
        # A multi-rank engine's 200 may be one rank's answer: unconfirmed until every rank is proven.
        return ResetAnswer.ACCEPTED_UNVERIFIED, reset.http_status
    return reset.outcome, reset.http_status


def record_with(record: dict[str, Any], reset: CacheReset, verification: Verification) -> dict[str, Any]:
    """The `infer.cache_state` record with the canary's result in `verified`, `reason` and `verification`."""
    updated = {**record, "verification": verification.to_json()}
    if not verification.ran or not reset.succeeded:
        return updated  # no canary, or a failed reset: the reference's words stand
    updated["verified"] = verification.verified.value
    if verification.verified == Verified.UNVERIFIED:
        updated["reason"] = (
            f"the engine accepted the cache reset, but the canary could not prove it: {verification.reason}"
        )
    else:
        updated["reason"] = verification.reason
    if verification.verified == Verified.CONTRADICTED and record["run_kind"] == "cold_start":
        # As the reference says of a failed reset: a cold start that did not happen is unspecified.
        updated["run_kind"] = str(RunKind.UNSPECIFIED)
    return updated
