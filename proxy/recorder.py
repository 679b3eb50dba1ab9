"""One fan-out for everything recorded: observations, forwarded exchanges and resets.

Each fact goes to the witness (verdicts), the evidence log and the metrics from here and
nowhere else, so a record and its counters cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiohttp import web

from proxy.evidence.log import EVIDENCE, EvidenceLog
from proxy.metrics import METRICS, Metrics
from proxy.observe import Observation
from proxy.observe.record import Forwarded
from proxy.vocabulary import CanaryOutcome, Verified
from proxy.witnesses.traffic import WITNESS, ResetSummary, Witness

__all__ = ["RECORDER", "Recorder", "setup_recorder"]


class Recorder:
    """Hands each finished fact to the witness, the evidence log and the metrics — one path."""

    def __init__(self, witness: Witness, evidence: EvidenceLog, metrics: Metrics) -> None:
        self.witness = witness
        self._evidence = evidence
        self._metrics = metrics

    def begin_request(self, case_header: str | None = None) -> tuple[str | None, int | None, bool]:
        """The reset this request belongs to, its ordinal since that reset, and whether
        `case_header` (its X-Cachewitness-Case) is that reset's case token."""
        own = self.witness.carries_token(case_header)
        reset_id, ordinal = self.witness.begin_request(own=own)
        return reset_id, ordinal, own

    def unobserved_request(self, case_header: str | None) -> None:
        """An inference request about to reach the engine unobserved (past the observation budget)."""
        self.witness.unobserved(own=self.witness.carries_token(case_header))

    def finished(self, forwarded: Forwarded, observation: Observation | None) -> None:
        """Record one forwarded exchange, with its observation when it was an admitted inference request.

        Never blocks, never raises into the forwarding path; the metrics move in one call.
        """
        settled = None
        if observation is not None:
            settled = self.witness.observe(observation)
            self._evidence.write(observation.to_record())
            if settled is not None:
                self._evidence.write(settled.to_record())
        self._metrics.finished(forwarded, observation, settled.verdict if settled is not None else None)

    def rejected(self, observation: Observation) -> None:
        """Record an inference request the sidecar answered itself (400, 413, 503).

        Evidence only: it never reached the engine, so it decides no verdict and counts no
        tokens (its status is already in `requests_total`). Bounded in rate (evidence_rejected_per_s):
        the cheapest requests to send must not rotate the evidence away.
        """
        self._evidence.write_rejected(observation.to_record())

    def reset_accepted(
        self,
        *,
        reset_id: str,
        session_id: str | None,
        case_id: str | None,
        at_ns: int,
        verified: Verified = Verified.UNVERIFIED,
        case_token: str | None = None,
        bind: bool = False,
    ) -> None:
        """An engine reset succeeded: requests from now on are numbered after it."""
        self.witness.reset_accepted(
            reset_id=reset_id,
            session_id=session_id,
            case_id=case_id,
            at_ns=at_ns,
            verified=verified,
            case_token=case_token,
            bind=bind,
        )

    def canary_request(self, outcome: CanaryOutcome) -> None:
        """Count one canary request (never an observation: it is no client traffic)."""
        self._metrics.canary_request(outcome)

    def reset_answered(
        self,
        records: Iterable[dict[str, Any]],
        summary: ResetSummary,
        *,
        engine_kind: str,
        answer: str,
        attempts: int,
        verified: Verified = Verified.UNVERIFIED,
    ) -> None:
        """One engine reset answered: each caller's record, the witness's summary, the counters once.

        `answer` is the engine's word; the counter takes the callers' (`summary.answer`), which is
        `contradicted` where a witness disproved an acknowledged reset.
        """
        for record in records:
            self._evidence.write(record)
        self.witness.reset_answered(summary)
        # Once per engine reset: coalesced callers count once.
        self._metrics.reset_answered(engine_kind, summary.answer, summary.duration_s, attempts)
        self._metrics.reset_verified(verified)

    def slot_erased(self, record: dict[str, Any]) -> None:
        """A llama.cpp slot erase a client made through the sidecar: recorded, but one slot is not a reset."""
        self._evidence.write(record)

    def cluster_reset(self, record: dict[str, Any]) -> None:
        """The receiving pod's record of a cluster-scope reset (each pod records its own part)."""
        self._evidence.write(record)


RECORDER = web.AppKey("recorder", Recorder)


def setup_recorder(app: web.Application) -> None:
    """The witness and the recorder (no lifetime of their own: they write through the evidence writer)."""
    witness = Witness()
    app[WITNESS] = witness
    app[RECORDER] = Recorder(witness, app[EVIDENCE], app[METRICS])
