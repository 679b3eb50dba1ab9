"""A reset across the engine's layout: SGLang's storage tier and vLLM's LMCache tier cleared with it,
every tier and rank judged.

The service reads the engine's layout (proxy/engines/topology.py) once per round; this module
adds the tier clears to each engine reset, and fills the verification's `tiers` and, for a
multi-rank engine, `ranks` (docs/reset.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import aiohttp

from proxy.config import Settings
from proxy.engines.base import CacheReset, EngineInfo
from proxy.engines.lmcache import ClearResult, TierOutcome, clear_tier, find_servers
from proxy.engines.topology import Topology, clear_storage
from proxy.vocabulary import EngineKind, TierState, Verified
from proxy.witnesses.ranks import rank_entries
from proxy.witnesses.tiers import TierPlan, judge_tiers, storage_tier, vllm_plan
from proxy.witnesses.verification import Verification

__all__ = ["LmcacheClear", "StorageClear", "TierClears", "judged", "tier_clears"]

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


LMCACHE_NONE_FOUND = (
    "lmcache_api = auto found no LMCache internal API server on the engine's host (ports from 6999): "
    "LMCache's tiers were not cleared; set internal_api_server_enabled in LMCache, or lmcache_api to its URLs"
)
LMCACHE_FAILED = "LMCache did not clear its tiers at {failed}: they may still hold prompts"
LMCACHE_WARM_HINT = (
    "LMCache answered success at {servers} but the canary was still served from the external tier "
    "(lmcache:num_hit_tokens rose; LMCache #1692, #1693, #1660): restart vLLM with LMCache, or clear "
    "its backends (local disk, remote store) out of band"
)


@dataclass
class LmcacheClear:
    """LMCache's tiers cleared at every internal API server after each accepted vLLM reset."""

    session: aiohttp.ClientSession
    upstream_base: str
    configured: tuple[str, ...]
    timeout_s: float
    results: list[ClearResult] = field(default_factory=list)
    asked: bool = False  # an accepted reset reached the clear

    async def after(self, done: CacheReset) -> CacheReset:
        """The engine reset, then `DELETE /cache/clear` at each server (only after an accepted reset)."""
        if not done.succeeded:
            return done
        self.asked = True
        servers = await find_servers(self.session, self.upstream_base, self.configured, self.timeout_s)
        results = [await clear_tier(self.session, base, self.timeout_s) for base in servers]
        self.results.extend(results)
        failed = [r.base_url for r in results if r.outcome == TierOutcome.FAILED]
        warning = done.warning
        if not servers:
            warning = warning or LMCACHE_NONE_FOUND
        elif failed:
            warning = warning or LMCACHE_FAILED.format(failed=", ".join(failed))
        return replace(done, calls=(*done.calls, *(r.call for r in results)), warning=warning)

    @property
    def cleared(self) -> bool | None:
        """True when every server answered and one cleared, None when any failed or none was found."""
        if not self.results:
            return None
        answered = all(r.outcome != TierOutcome.FAILED for r in self.results)
        return True if answered and any(r.outcome == TierOutcome.CLEARED for r in self.results) else None

    def servers(self) -> str:
        """The servers that answered success, with what each said it removed."""
        return ", ".join(
            f"{r.base_url} (num_removed {r.removed})"
            for r in self.results
            if r.outcome == TierOutcome.CLEARED
        )


@dataclass
class TierClears:
    """The clears of tiers the engine's own reset does not reach, run after it in order."""

    storage: StorageClear | None = None
    lmcache: LmcacheClear | None = None

    async def after(self, done: CacheReset) -> CacheReset:
        """The engine reset, then each tier's clear."""
        for clear in (self.storage, self.lmcache):
            if clear is not None:
                done = await clear.after(done)
        return done


def tier_clears(
    session: aiohttp.ClientSession, settings: Settings, engine: EngineInfo, topology: Topology
) -> TierClears | None:
    """The tier clears this reset runs: SGLang's HiCache storage, vLLM's LMCache; None without either."""
    timeout_s, base = settings.reset_attempt_timeout, settings.upstream_base
    storage = (
        StorageClear(session, base, timeout_s, settings.engine_key)
        if engine.kind == EngineKind.SGLANG and topology.storage_backend and settings.clear_storage_tier
        else None
    )
    lmcache = (
        LmcacheClear(session, base, settings.lmcache_api, timeout_s)
        if engine.kind == EngineKind.VLLM and settings.lmcache_api
        else None
    )
    return TierClears(storage, lmcache) if storage is not None or lmcache is not None else None


def plan(engine: EngineInfo, topology: Topology, clears: TierClears | None) -> TierPlan:
    """What this reset asked of each tier."""
    asked = vllm_plan(engine.version) if engine.kind == EngineKind.VLLM else TierPlan.everything()
    storage = clears.storage if clears is not None else None
    lmcache = clears.lmcache if clears is not None else None
    if lmcache is not None and lmcache.asked:
        asked = asked.but("external", lmcache.cleared)
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
    clears: TierClears | None,
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
    asked = plan(engine, topology, clears)
    for tier in unsupported_tiers:
        asked = asked.but(tier, False)
    tiers = judge_tiers(engine.kind, asked, verification)
    judged = replace(verification, tiers={tier: state.value for tier, state in tiers.items()}, ranks=ranks)
    lmcache = clears.lmcache if clears is not None else None
    if lmcache is not None and tiers["external"] == TierState.WARM:
        return _lmcache_contradicted(judged, lmcache)
    return judged


def _lmcache_contradicted(verification: Verification, lmcache: LmcacheClear) -> Verification:
    """A canary served from LMCache's tier after LMCache said it cleared: the tier named in reason and hint."""
    servers = lmcache.servers() or "no server"
    reason = f"{verification.reason}; the external tier (LMCache) still served it after LMCache answered success at {servers}"
    hint = LMCACHE_WARM_HINT.format(servers=servers)
    if verification.verified != Verified.CONTRADICTED:
        return replace(verification, reason=reason)
    return replace(verification, reason=reason, hint=hint)
