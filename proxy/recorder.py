"""One fan-out for everything recorded: observations, forwarded exchanges and resets.

Each fact goes to the witness (verdicts), the evidence log, the metrics and, with
`kv_events_endpoint`, the KV events index from here and nowhere else, so a record and its
counters cannot disagree.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any, NamedTuple

from aiohttp import web

from proxy.admission import ADMISSION
from proxy.config import SETTINGS
from proxy.engine_state import ENGINE
from proxy.evidence.log import EVIDENCE, EvidenceLog
from proxy.evidence.reserve import CaseReserve
from proxy.metrics import METRICS, Metrics
from proxy.observe import Observation
from proxy.observe.record import Forwarded
from proxy.upstream.pools import UPSTREAM_POOL
from proxy.vocabulary import CanaryOutcome, EventType, Verdict, Verified
from proxy.witnesses.case import CaseWitness
from proxy.witnesses.counters import CaseVerdict
from proxy.witnesses.kv_events.index import CacheIndex
from proxy.witnesses.kv_events.subscribers import KvEvents
from proxy.witnesses.traffic import WITNESS, ResetSummary, Witness

__all__ = ["RECORDER", "UNNUMBERED", "Numbered", "Recorder", "setup_recorder"]

_OBSERVATION, _VERIFICATION = str(EventType.CACHE_OBSERVATION), str(EventType.CACHE_VERIFICATION)


class Numbered(NamedTuple):
    """Where an admitted inference request stands: the reset it follows (None before the first),
    its ordinal since that reset, and whether it carried that reset's case token.

    A NamedTuple, frozen as a dataclass would be, built in a fraction of the time (one per request).
    """

    reset_id: str | None
    ordinal: int | None
    own: bool


UNNUMBERED = Numbered(None, None, False)  # a request the drain gate never admitted


class Recorder:
    """Hands each finished fact to the witness, the evidence log and the metrics — one path."""

    def __init__(
        self, witness: Witness, evidence: EvidenceLog, metrics: Metrics, index: CacheIndex | None = None
    ) -> None:
        """`index`: the KV events index, with `kv_events_endpoint` only."""
        self.witness = witness
        self._evidence = evidence
        self._metrics = metrics
        self._index = index
        # Whether a request's session and case ids are wanted (the index records each case's start).
        self.follows_cases = index is not None
        self.case: CaseWitness | None = None  # the counter witness, once setup_recorder made it
        # The open case's observations kept in the resets file (proxy/evidence/reserve.py).
        self._reserve = CaseReserve()

    @property
    def kv_events(self) -> KvEvents | None:
        """The engine's KV events subscribers (the events witness reads them), None without them."""
        return self._index.events if self._index is not None else None

    def begin_request(
        self, case_header: str | None = None, *, session_id: str | None = None, case_id: str | None = None
    ) -> Numbered:
        """The reset this request belongs to, its ordinal since that reset, and whether
        `case_header` (its X-Cachewitness-Case) is that reset's case token.

        A case's first request (`case_id`, its stored X-Case-Id) records what the engine's cache
        holds as the case starts, where the KV events say it.
        """
        own = self.witness.carries_token(case_header)
        reset_id, ordinal = self.witness.begin_request(own=own)
        if self._index is not None:
            self._index.request_started(session_id, case_id)
        return Numbered(reset_id, ordinal, own)

    def unobserved_request(self, case_header: str | None) -> None:
        """An inference request about to reach the engine unobserved (past the observation budget)."""
        self.witness.unobserved(own=self.witness.carries_token(case_header))
        if self.case is not None:
            self.case.unobserved()

    def finished(self, forwarded: Forwarded, observation: Observation | None) -> None:
        """Record one forwarded exchange, with its observation when it was an admitted inference request.

        Never blocks, never raises into the forwarding path; the metrics move in one call.
        """
        settled = None
        if observation is not None:
            if self.case is not None:
                self.case.observed(observation)
            settled = self.witness.observe(observation)
            # Built at the flush, in a batch: the records are frozen, their order kept.
            # The request that settled the verdict is kept too, whoever sent it.
            keep = self._reserve.keeps(observation) or settled is not None
            self._evidence.write_later(_OBSERVATION, observation.to_record, keep=keep)
            if settled is not None:
                self._evidence.write_later(_VERIFICATION, settled.to_record)
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
        """An engine reset succeeded: the KV events index as it leaves it, and requests from now
        on numbered after it."""
        if self._index is not None:
            self._index.reset_answered(
                reset_id=reset_id, session_id=session_id, case_id=case_id, verified=verified
            )
        self._reserve.opened(session_id, case_id)
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


def setup_recorder(app: web.Application, index: CacheIndex | None = None) -> None:
    """The witness, the counter witness and the recorder (over `index`, the KV events index, when
    there is one); the engine watcher runs while the pool is open."""
    witness = Witness()
    app[WITNESS] = witness
    recorder = Recorder(witness, app[EVIDENCE], app[METRICS], index)
    app[RECORDER] = recorder
    settings, evidence, metrics = app[SETTINGS], app[EVIDENCE], app[METRICS]

    def revise(reset_id: str | None, verdict: CaseVerdict, reason: str) -> None:
        weaker = Verdict.CONTRADICTED if verdict == CaseVerdict.CONTRADICTED else Verdict.INCONCLUSIVE
        witness.revise(reset_id, weaker, reason)

    case = CaseWitness(
        session=lambda: app[UPSTREAM_POOL],
        base_url=settings.upstream_base,
        kind=lambda: app[ENGINE].info.kind,
        timeout_s=settings.reset_attempt_timeout,
        idle_s=settings.case_idle_s,
        in_flight=lambda: app[ADMISSION].inflight,
        write=evidence.write,
        on_bypass=metrics.bypass,
        on_event=lambda kind: metrics.engine_event(kind.value),
        on_verdict=revise,
        api_key=settings.engine_key,
    )
    recorder.case = case
    witness.case_state = case.state

    async def lifetime(_app: web.Application) -> AsyncIterator[None]:
        watcher = asyncio.create_task(case.watch(settings.health_interval), name="cachewitness-case-watch")
        yield
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

    app.cleanup_ctx.append(lifetime)
