"""A reset across the engine's layout: SGLang's storage tier cleared with it, every tier and rank judged.

The service reads the engine's layout (proxy/engines/topology.py) once per round; this module
adds the storage clear to each engine reset, and fills the verification's `tiers` and, for a
multi-rank engine, `ranks` (docs/reset.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import aiohttp

from proxy.engines.base import CacheReset, EngineInfo
from proxy.engines.topology import Topology, clear_storage
from proxy.vocabulary import EngineKind
from proxy.witnesses.ranks import rank_entries
from proxy.witnesses.tiers import TierPlan, judge_tiers, storage_tier, vllm_plan
from proxy.witnesses.verification import Verification

__all__ = ["StorageClear", "judged"]

STORAGE_CLEAR_FAILED = (
    "the engine flushed its cache but refused to clear its HiCache storage tier "
    "(POST /hicache/storage-backend/clear): the storage tier may still hold prompts"
)


@dataclass
class StorageClear:
    """SGLang's storage-tier clear after each accepted flush; what each clear answered."""

    session: aiohttp.ClientSession
    base_url: str
    timeout_s: float
    api_key: str | None = field(default=None, repr=False)
    results: list[bool] = field(default_factory=list)

    async def after(self, done: CacheReset) -> CacheReset:
        """The flush, then the storage clear (only after a flush the engine accepted)."""
        if not done.succeeded:
            return done
        cleared, call = await clear_storage(self.session, self.base_url, self.timeout_s, self.api_key)
        self.results.append(cleared)
        warning = done.warning if cleared else (done.warning or STORAGE_CLEAR_FAILED)
        return replace(done, calls=(*done.calls, call), warning=warning)


def plan(engine: EngineInfo, topology: Topology, storage: StorageClear | None) -> TierPlan:
    """What this reset asked of each tier."""
    asked = vllm_plan(engine.version) if engine.kind == EngineKind.VLLM else TierPlan.everything()
    if engine.kind == EngineKind.SGLANG and topology.storage_backend is not None:
        tier = storage_tier(topology.storage_backend)
        if storage is None:
            asked = asked.but(tier, False)  # clear_storage_tier = false
        elif not storage.results or not all(storage.results):
            asked = asked.but(tier, None)  # never sent (no flush was accepted), or refused
    return asked


def judged(
    verification: Verification,
    engine: EngineInfo,
    topology: Topology,
    storage: StorageClear | None,
    *,
    events_ran: bool,
    unsupported_tiers: tuple[str, ...] = (),
) -> Verification:
    """The verification with its `tiers`, and `ranks` wherever the engine has more than one.

    A tier the engine said it cannot reset (`unsupported_tiers`) was not asked: `not_requested`.
    """
    ranks = verification.ranks
    if topology.multi_rank and not ranks:
        ranks = rank_entries(topology.ranks, verification, "events" if events_ran else "none")
    asked = plan(engine, topology, storage)
    for tier in unsupported_tiers:
        asked = asked.but(tier, False)
    tiers = judge_tiers(engine.kind, asked, verification)
    return replace(verification, tiers={tier: state.value for tier, state in tiers.items()}, ranks=ranks)
