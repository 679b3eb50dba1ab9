"""What a cluster reset found: each pod's part (`PodReset`), the whole (`ClusterReset`), the answer and record.

The worst pod decides the cluster's answer; a pod is read from its own `/cache/reset` answer,
or from why it gave none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.cluster.peers import Peer, PeerSet
from proxy.engines.base import CacheReset
from proxy.evidence.records import cache_state_record
from proxy.reset.params import ResetParams
from proxy.vocabulary import ResetAnswer, Scope, Verified, VerifyMode, Via

__all__ = ["ClusterReset", "PodReset", "pod_answer", "unreached"]


@dataclass(frozen=True)
class PodReset:
    """One peer's part of a cluster reset: what it answered, or why it could not."""

    pod: str
    url: str
    status: int | None
    answer: str
    verified: Verified
    reset_id: str | None
    error: str | None = None
    witness_ran: bool = False  # a witness (canary, events) judged this pod's reset
    hint: str | None = None

    @property
    def unknown(self) -> bool:
        """Nobody knows whether this pod's engine was reset: the pod or its engine was not reached."""
        return self.answer in (ResetAnswer.UNREACHABLE, ResetAnswer.ERROR)

    @property
    def contradicted(self) -> bool:
        """The pod's canary saw cached tokens after the reset."""
        return self.answer == ResetAnswer.CONTRADICTED or self.verified == Verified.CONTRADICTED

    @property
    def confirmed(self) -> bool:
        """Acknowledged, and verified by every witness that ran (the pod's `verified` combines them)."""
        return self.answer == ResetAnswer.ACKNOWLEDGED and (
            not self.witness_ran or self.verified == Verified.VERIFIED
        )

    def to_json(self) -> dict[str, Any]:
        """The entry of the answer's and the record's `pods` list."""
        entry: dict[str, Any] = {
            "pod": self.pod,
            "url": self.url,
            "status": self.status,
            "answer": self.answer,
            "verified": self.verified.value,
            "reset_id": self.reset_id,
            "error": self.error,
        }
        if self.hint:
            entry["hint"] = self.hint
        return entry


@dataclass(frozen=True)
class ClusterReset:
    """A whole cluster reset: its id, the peers it reached for, and each pod's part."""

    reset_id: str
    peers: PeerSet
    pods: tuple[PodReset, ...]
    at_ns: int
    answered_at_ns: int
    deadline_s: float

    @property
    def answer(self) -> ResetAnswer:
        """The cluster's word: the worst pod decides (docs/cluster.md)."""
        pods = self.pods
        if not pods:
            return ResetAnswer.ERROR
        if any(pod.unknown for pod in pods):
            return ResetAnswer.PARTIAL
        if any(pod.contradicted for pod in pods):
            return ResetAnswer.CONTRADICTED
        if any(pod.answer == ResetAnswer.REFUSED for pod in pods):
            return ResetAnswer.REFUSED
        if any(pod.answer == ResetAnswer.UNSUPPORTED for pod in pods):
            return ResetAnswer.UNSUPPORTED
        if all(pod.confirmed for pod in pods):
            return ResetAnswer.ACKNOWLEDGED
        # Accepted everywhere, but some pod could not confirm it (an empty 2xx, an inconclusive canary).
        return ResetAnswer.ACCEPTED_UNVERIFIED

    @property
    def http_status(self) -> int:
        """200 all accepted, 409 refused, 501 unsupported, 502 contradicted, partial or no peers."""
        return {
            ResetAnswer.ACKNOWLEDGED: 200,
            ResetAnswer.ACCEPTED_UNVERIFIED: 200,
            ResetAnswer.CONTRADICTED: 502,
            ResetAnswer.REFUSED: 409,
            ResetAnswer.UNSUPPORTED: 501,
        }.get(self.answer, 502)

    @property
    def verified(self) -> Verified:
        """Contradicted if any pod was, verified if every pod was, else unverified."""
        if any(pod.contradicted for pod in self.pods):
            return Verified.CONTRADICTED
        if self.pods and all(pod.verified == Verified.VERIFIED for pod in self.pods):
            return Verified.VERIFIED
        return Verified.UNVERIFIED

    @property
    def error(self) -> str | None:
        """What went wrong, naming the pods; None when every pod accepted."""
        if not self.pods:
            return f"{ResetAnswer.ERROR}: {self.peers.error or 'no peers'}"
        failed = [
            pod
            for pod in self.pods
            if pod.answer not in (ResetAnswer.ACKNOWLEDGED, ResetAnswer.ACCEPTED_UNVERIFIED)
        ]
        failed += [pod for pod in self.pods if pod.contradicted and pod not in failed]
        if not failed:
            return None
        named = "; ".join(
            f"{pod.pod} {pod.answer}" + (f" ({pod.error})" if pod.error else "") for pod in failed
        )
        return f"{self.answer}: {len(failed)} of {len(self.pods)} pods: {named}"

    @property
    def hint(self) -> str | None:
        """How to fix what failed."""
        if not self.pods:
            return self.peers.hint
        answer = self.answer
        if answer == ResetAnswer.PARTIAL:
            return (
                "a pod named unreachable may be restarting or not serving; its engine may still hold its "
                "cache: retry the cluster reset, or read that pod's /cache/state"
            )
        if answer in (ResetAnswer.REFUSED, ResetAnswer.CONTRADICTED):
            return "see each pod's answer; a refused pod was busy past retry_seconds (raise it, or drain)"
        if answer == ResetAnswer.UNSUPPORTED:
            return next((pod.hint for pod in self.pods if pod.hint), None)
        return None

    def cache_state(self, params: ResetParams) -> dict[str, Any]:
        """The receiving pod's `infer.cache_state` record for the whole cluster: the reference's shape,
        `scope: "cluster"` and the per-pod list."""
        answer = self.answer
        reset = CacheReset(
            url="",
            at_ns=self.at_ns,
            status=self.http_status,
            error=self.error,
            attempts=1,
            answered_at_ns=self.answered_at_ns,
            outcome=answer,
        )
        record = cache_state_record(
            session_id=params.session_id,
            case_id=params.case_id,
            requested=params.requested,
            reset=reset,
            warmup_requests=params.warmup_requests,
            reset_id=self.reset_id,
            engine=None,
            at_ns=self.answered_at_ns,
            via=Via.CLUSTER,
        )
        record["reset"]["url"] = None  # many URLs: each pod's is in `pods`
        record["verified"] = self.verified.value
        record["scope"] = str(Scope.CLUSTER)
        record["peers_source"] = self.peers.source
        record["pods"] = [pod.to_json() for pod in self.pods]
        return record

    def to_json(self, params: ResetParams, record: dict[str, Any]) -> dict[str, Any]:
        """The answer's body."""
        body: dict[str, Any] = {}
        answer = self.answer
        if answer != ResetAnswer.ACCEPTED_UNVERIFIED:
            # As for one pod: absent, not null, when unconfirmed.
            body["success"] = answer == ResetAnswer.ACKNOWLEDGED
        body.update(
            {
                "answer": answer,
                "scope": str(Scope.CLUSTER),
                "reset_id": self.reset_id,
                "pods": [pod.to_json() for pod in self.pods],
                "peers_source": self.peers.source,
                "at_ns": self.at_ns,
                "answered_at_ns": self.answered_at_ns,
                "deadline_s": self.deadline_s,
                "session_id": params.session_id,
                "case_id": params.case_id,
                "cache_state": record,
            }
        )
        if self.error:
            body["detail"] = self.error
        if self.hint:
            body["hint"] = self.hint
        return body


def unreached(peer: Peer, url: str, error: str) -> PodReset:
    """A pod that gave no reset answer."""
    return PodReset(peer.address, url, None, ResetAnswer.UNREACHABLE, Verified.UNVERIFIED, None, error)


def pod_answer(peer: Peer, url: str, status: int, raw: bytes) -> PodReset:
    """A pod's part from its HTTP answer; an answer that is not a reset answer is an error."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("answer"), str):
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        if not isinstance(message, str):
            message = raw[:200].decode("utf-8", errors="replace") or "(no body)"
        return PodReset(
            peer.address,
            url,
            status,
            ResetAnswer.ERROR,
            Verified.UNVERIFIED,
            None,
            f"HTTP {status}: {message}",
        )
    verification = body.get("verification")
    # Any witness counts, not only the canary: under `events` or `both` an unverified pod is unconfirmed.
    method = verification.get("method") if isinstance(verification, dict) else None
    witness_ran = isinstance(method, str) and method != VerifyMode.NONE
    try:
        verified = Verified(body.get("verified", Verified.UNVERIFIED))
    except ValueError:
        verified = Verified.UNVERIFIED
    error = body.get("detail") if isinstance(body.get("detail"), str) else None
    if error is None and witness_ran and verified != Verified.VERIFIED and isinstance(verification, dict):
        # The witnesses' own sentence, quoting the engine's numbers: why this pod is not verified.
        reason = verification.get("reason")
        error = reason if isinstance(reason, str) else None
    return PodReset(
        peer.address,
        url,
        status,
        body["answer"],
        verified,
        body.get("reset_id") if isinstance(body.get("reset_id"), str) else None,
        error=error,
        witness_ran=witness_ran,
        hint=body.get("hint") if isinstance(body.get("hint"), str) else None,
    )
