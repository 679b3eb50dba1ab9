"""The per-tier verdict of a reset: which of the engine's cache tiers the canary still found warm (docs/reset.md).

Each tier (`device`, `host`, `disk`, `external`) is `cleared`, `warm`, `not_requested` or `unknown`.
The evidence is the canary's probes after the reset: vLLM says per tier where a probe's cached
tokens came from (`vllm:prompt_tokens_cached_by_source_total{source}`, read before and after the
probes); without such a counter, probes that all ran cold clear every tier, and a warm probe is
attributed only where the engine's structure says where it can come from (llama.cpp: its slots
were erased, so a hit is the `--cache-ram` host prompt cache). What the reset asked for comes
from the engine: vLLM clears its connector tiers only with `reset_external` (0.13+); SGLang's
storage tier only with `POST /hicache/storage-backend/clear` (config `clear_storage_tier`).

A warm tier means a canary probe hit cached tokens: the canary's own rule already makes that
reset `contradicted`; the tiers say where the canary was found.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from proxy.engines.counters import read_totals_settled
from proxy.observe.tiers import STORAGE_DISK_BACKENDS
from proxy.vocabulary import TIERS, EngineKind, TierState
from proxy.witnesses.verification import Verification

__all__ = ["TierPlan", "judge_tiers", "read_by_tier", "storage_tier", "tier_delta", "tier_sum", "vllm_plan"]

# vLLM clears connector and offload tiers on `reset_external=true` from 0.13 on (older ones ignore it).
_RESET_EXTERNAL_SINCE = (0, 13)
_VERSION = re.compile(r"(\d+)\.(\d+)")


@dataclass(frozen=True)
class TierPlan:
    """What the reset asked of each tier: True asked (and accepted), False not asked, None asked but refused."""

    requested: Mapping[str, bool | None]

    @classmethod
    def everything(cls) -> TierPlan:
        """A reset that covers every tier the engine has (a tier it has not holds nothing)."""
        return cls(dict.fromkeys(TIERS, True))

    def but(self, tier: str, asked: bool | None) -> TierPlan:
        """This plan with one tier's answer changed."""
        return TierPlan({**self.requested, tier: asked})


def vllm_plan(version: str | None) -> TierPlan:
    """vLLM: the device always; host, disk and external only where `reset_external` is understood."""
    found = _VERSION.search(version or "")
    if found is None or (int(found.group(1)), int(found.group(2))) >= _RESET_EXTERNAL_SINCE:
        return TierPlan.everything()
    plan = TierPlan.everything()
    for tier in ("host", "disk", "external"):
        plan = plan.but(tier, False)
    return plan


def storage_tier(backend: str) -> str:
    """The tier of an SGLang HiCache storage backend: `file` is a local disk, the others are remote stores."""
    return "disk" if backend.strip().lower() in STORAGE_DISK_BACKENDS else "external"


def tier_delta(before: Mapping[str, int] | None, after: Mapping[str, int] | None) -> dict[str, int] | None:
    """Cached tokens per tier between two reads; None when either read had no per-tier counter."""
    if before is None or after is None or not after:
        return None
    return {tier: max(0, after.get(tier, 0) - before.get(tier, 0)) for tier in TIERS}


def tier_sum(answers: list[Mapping[str, int] | None]) -> dict[str, int] | None:
    """Cached tokens per tier over answers that each named theirs; None when any did not."""
    if not answers or any(tiers is None for tiers in answers):
        return None
    return {tier: sum(tiers.get(tier, 0) for tiers in answers if tiers is not None) for tier in TIERS}


async def read_by_tier(
    session: aiohttp.ClientSession,
    base_url: str,
    kind: str,
    timeout_s: float,
    api_key: str | None,
    storage: str = "external",
) -> dict[str, int] | None:
    """The engine's cached tokens per tier (vLLM, TensorRT-LLM, SGLang), from a settled read of its counters."""
    if kind not in (EngineKind.VLLM, EngineKind.TRTLLM, EngineKind.SGLANG):
        return None
    _reachable, totals = await read_totals_settled(session, base_url, kind, timeout_s, api_key)
    if totals is None or not totals.by_tier:
        return None
    by_tier: dict[str, int] = {}
    for tier, tokens in totals.by_tier.items():
        named = storage if tier == "storage" else tier  # SGLang's HiCache storage tier
        by_tier[named] = by_tier.get(named, 0) + tokens
    return by_tier


def judge_tiers(kind: str, plan: TierPlan, verification: Verification) -> dict[str, TierState]:
    """Each tier's state from what the reset asked for and what the canary's probes found."""
    readings = verification.after
    probed = len(readings) >= 2 and all(reading.cached is not None for reading in readings)
    cold = probed and not any(reading.cached for reading in readings)
    by_tier = verification.cached_by_tier if probed else None
    states: dict[str, TierState] = {}
    for tier in TIERS:
        asked = plan.requested.get(tier, True)
        if by_tier is not None and by_tier.get(tier, 0) > 0:
            states[tier] = TierState.WARM  # the engine itself says a probe was served from it
        elif asked is False:
            states[tier] = TierState.NOT_REQUESTED
        elif asked is None or not probed:
            states[tier] = TierState.UNKNOWN
        elif by_tier is not None or cold:
            states[tier] = TierState.CLEARED
        else:
            states[tier] = _attributed(kind, tier)
    return states


def _attributed(kind: str, tier: str) -> TierState:
    """A warm probe without a per-tier counter: where the engine's structure says the hit came from."""
    if kind == EngineKind.LLAMACPP:
        # The reset erased every slot: only the host-RAM prompt cache (--cache-ram) can still serve a prompt.
        return TierState.WARM if tier == "host" else TierState.CLEARED
    return TierState.UNKNOWN
