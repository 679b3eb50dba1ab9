"""Every closed word set of the sidecar, in one place at the bottom of the layers.

Each word is written once, here; a field that holds one of these words is typed with its
enum, not `str`. They are `StrEnum`s, so each member is the very string the answers, records,
labels and logs carry (see docs/reset.md, docs/evidence.md, docs/metrics.md), and a JSON
encoder writes the value.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "TIERS",
    "CanaryOutcome",
    "EngineKind",
    "EventType",
    "Outcome",
    "Requested",
    "ResetAnswer",
    "RunKind",
    "Scope",
    "ServedBy",
    "TierState",
    "Verdict",
    "Verified",
    "VerifyMode",
    "Via",
]


class EngineKind(StrEnum):
    """The engines the sidecar knows; `unknown` while `--engine auto` has not reached the upstream."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    MINDNANO = "mindnano"
    TRTLLM = "trtllm"  # TensorRT-LLM's trtllm-serve
    DYNAMO = "dynamo"  # NVIDIA Dynamo's frontend
    GENERIC = "generic"
    NONE = "none"
    UNKNOWN = "unknown"


class ResetAnswer(StrEnum):
    """The `answer` of a reset (docs/reset.md): what became of it, as the caller is told.

    The first six are what an engine reset itself can come to (the reference client's three
    words, then the sidecar's own); `contradicted` is a witness's (the canary saw cached tokens
    after an accepted reset), `partial` a cluster reset's (some pod was not reached).
    """

    ACKNOWLEDGED = "acknowledged"
    ACCEPTED_UNVERIFIED = "accepted_unverified"
    REFUSED = "refused"
    UNSUPPORTED = "unsupported"
    UNREACHABLE = "unreachable"
    ERROR = "error"
    CONTRADICTED = "contradicted"
    PARTIAL = "partial"

    @property
    def is_reference(self) -> bool:
        """One of the reference client's words (acknowledged, refused, accepted_unverified)."""
        return self in (ResetAnswer.ACKNOWLEDGED, ResetAnswer.REFUSED, ResetAnswer.ACCEPTED_UNVERIFIED)


class Via(StrEnum):
    """How a reset reached the sidecar (the `via` of `infer.cache_state`)."""

    API = "api"  # POST /cache/reset
    NATIVE = "native"  # the engine's own reset route, called through the sidecar
    CLUSTER = "cluster"  # a cluster-scope reset's own record (proxy/cluster/fanout.py)


class Scope(StrEnum):
    """Where a reset or a read reaches (input and record `scope`; docs/cluster.md)."""

    POD = "pod"  # this sidecar's engine
    CLUSTER = "cluster"  # every peer sidecar's, fanned out from this one


class Requested(StrEnum):
    """The cache state a caller asks a reset for (input and record `requested`)."""

    COLD = "cold"
    UNSPECIFIED = "unspecified"


class RunKind(StrEnum):
    """Whether a case was designed as a cold start or a warmed-up steady state (record `run_kind`)."""

    COLD_START = "cold_start"
    STEADY_STATE = "steady_state"
    UNSPECIFIED = "unspecified"


class Verified(StrEnum):
    """What the canary proved about a reset (the record's `verified`)."""

    VERIFIED = "verified"
    CONTRADICTED = "contradicted"
    UNVERIFIED = "unverified"


class VerifyMode(StrEnum):
    """How a reset is verified: input `verify`, config `verify`."""

    CANARY = "canary"
    EVENTS = "events"  # the engine's KV cache events (proxy/witnesses/kv_events/witness.py)
    BOTH = "both"  # every witness that can run
    NONE = "none"


class CanaryOutcome(StrEnum):
    """Label of `cachewitness_canary_requests_total`: how one canary request ended."""

    OK = "ok"  # answered with a cached-token count
    UNREPORTED = "unreported"  # answered 2xx without one
    FAILED = "failed"  # no 2xx answer


class TierState(StrEnum):
    """One cache tier in a reset's `verification.tiers` (docs/reset.md)."""

    CLEARED = "cleared"  # the reset asked for it and the canary's probes found nothing cached there
    WARM = "warm"  # a canary probe after the reset was served from it
    NOT_REQUESTED = "not_requested"  # the reset did not ask the engine to clear it
    UNKNOWN = "unknown"  # no witness could tell


# The tiers every verification names, nearest the accelerator first.
TIERS: tuple[str, ...] = ("device", "host", "disk", "external")


class Verdict(StrEnum):
    """The traffic verdict of an accepted reset (docs/reset.md)."""

    CONSISTENT = "consistent"
    CONTRADICTED = "contradicted"
    INCONCLUSIVE = "inconclusive"
    UNOBSERVABLE = "unobservable"
    PENDING = "pending"


class Outcome(StrEnum):
    """How a forwarded exchange ended (the `outcome` of observations and of the request metrics)."""

    OK = "ok"  # the engine's response reached the client whole
    CLIENT_DISCONNECTED = "client_disconnected"
    CLIENT_STALLED = "client_stalled"  # cut by client_write_timeout: it stopped reading the response
    UPSTREAM_ERROR = "upstream_error"
    TIMEOUT = "timeout"
    REJECTED = "rejected"  # answered by the sidecar itself (400, 413, 503), never by the engine


class ServedBy(StrEnum):
    """Which HTTP server took a client request (the `served_by` label of requests_total)."""

    FRONT = "front"  # the front: plain inference requests on httptools (proxy/inbound/)
    AIOHTTP = "aiohttp"  # every other request, and every later one of its connection


class EventType(StrEnum):
    """The `event_type` of every record the sidecar writes or serves (docs/evidence.md)."""

    CACHE_STATE = "infer.cache_state"
    CACHE_OBSERVATION = "infer.cache_observation"
    CACHE_VERIFICATION = "infer.cache_verification"
    CACHE_BLOCKS = "infer.cache_blocks"  # the engine's KV index at a reset and a case start
    CACHE_RECONCILIATION = "infer.cache_reconciliation"  # engine counters against what was seen
    ENGINE_EVENT = "infer.engine_event"  # a restart, a sleep, an outage: the cache is unknown
    EVIDENCE_OPENED = "infer.evidence_opened"  # a writer's start: where its chain resumes
    EVIDENCE_CHECKPOINT = "infer.evidence_checkpoint"  # a signed chain head (docs/evidence.md)
    EVIDENCE_ROTATED = "infer.evidence_rotated"  # a rotation dropped a file: what history it held
    # The trailer of a scope=cluster evidence read: which pods answered (docs/cluster.md).
    CLUSTER_READ = "cachewitness.cluster_read"
    # The lines of a proof (`GET /cache/evidence?proof=1`, docs/evidence.md) that are no record:
    PROOF_CHAIN = "cachewitness.proof_chain"  # the lines that follow are of this file's chain
    PROOF_POD = "cachewitness.proof_pod"  # in a cluster's proof: the lines of this pod follow
    PROOF_READ = "cachewitness.proof_read"  # a pod's proof ends: what each chain sent
    PROOF_CHECKPOINT = "cachewitness.checkpoint"  # a Merkle proof's signed checkpoint, its line carried whole
    PROOF_INCLUSION = "cachewitness.inclusion"  # a record, its leaf index and audit path to a checkpoint
    PROOF_CONSISTENCY = "cachewitness.consistency"  # two checkpoints of one life: the proof between them
