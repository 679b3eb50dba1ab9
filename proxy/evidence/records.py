"""The `infer.cache_state` record: the reference client's shape, and its words (docs/evidence.md).

The reference benchmark client (stormlog `infer.cache_state`) writes a record per case;
`cache_state_record` and `run_kind` reproduce its shape and wording exactly, so the sidecar
is a drop-in reset target. Its users (the reset service, the native reset routes, the
cluster reset) stand above engines and evidence, so this schema may name the engine values.
"""

from __future__ import annotations

import time
from typing import Any

from proxy.engines.base import CacheReset, EngineInfo
from proxy.vocabulary import EventType, Requested, RunKind, Verified, Via

__all__ = ["cache_state_record", "run_kind"]


def run_kind(requested: Requested, warmup_requests: int, reset: CacheReset | None = None) -> RunKind:
    """Whether a case was designed as a cold start or a warmed-up steady state (the reference's rule)."""
    if warmup_requests > 0:
        return RunKind.STEADY_STATE
    if requested == Requested.COLD and (reset is None or reset.succeeded):
        return RunKind.COLD_START
    return RunKind.UNSPECIFIED


def _reason(requested: Requested, reset: CacheReset | None) -> str:
    """The reference's sentence for why a cache state is what it is."""
    if reset is not None and not reset.succeeded:
        return f"the cache reset failed ({reset.error or reset.status})"
    if reset is not None and reset.acknowledged:
        return "the server acknowledged the cache reset, but no engine adapter can confirm it"
    if reset is not None:
        return (
            f"the cache reset returned HTTP {reset.status} without saying "
            "whether it succeeded, and no engine adapter can confirm it"
        )
    if requested == Requested.COLD:
        return "nothing reset the cache, and no engine adapter can read it"
    return (
        "no cache state was requested; earlier traffic, including an earlier "
        "run with the same seed, decides what the cache holds"
    )


def cache_state_record(
    *,
    session_id: str | None,
    case_id: str | None,
    requested: Requested,
    reset: CacheReset | None,
    warmup_requests: int,
    reset_id: str | None = None,
    engine: EngineInfo | None = None,
    at_ns: int | None = None,
    via: Via = Via.API,
) -> dict[str, Any]:
    """The `infer.cache_state` record (docs/evidence.md): the reference's shape plus `at_ns`, `reset_id`, `engine`, `via`."""
    return {
        "schema_version": 1,
        "event_type": str(EventType.CACHE_STATE),
        "at_ns": at_ns if at_ns is not None else time.time_ns(),
        "session_id": session_id,
        "case_id": case_id,
        "requested": str(requested),
        "reset": reset.to_record() if reset is not None else None,
        "attempted": reset is not None,
        "acknowledged": reset is not None and reset.acknowledged,
        "verified": str(Verified.UNVERIFIED),
        "reason": _reason(requested, reset),
        "run_kind": str(run_kind(requested, warmup_requests, reset)),
        "reset_id": reset_id,
        "engine": engine.to_json() if engine is not None else None,
        "via": str(via),
    }
