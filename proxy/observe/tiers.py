"""Cached tokens per tier where an engine's answer says them (the observation's `cached_by_tier`).

SGLang (#17648): a request with `return_cached_tokens_details` gets `sglext.cached_tokens_details`
`{device, host, storage, storage_backend}` (on the answer, or on a stream chunk of its own;
sglang/srt/entrypoints/openai/serving_chat.py); `storage` is the HiCache storage tier, a local
disk for the `file` backend, else a remote store. vLLM (#52199): `local_cached_tokens` and
`external_cached_tokens` beside `cached_tokens` in `usage.prompt_tokens_details`, where present.
Only the tiers the engine names are given; None when it names none (never 0 for unknown).
"""

from __future__ import annotations

from typing import Any

__all__ = ["STORAGE_DISK_BACKENDS", "tiers_from"]

# SGLang storage backends that are a local disk (its tests name `file` and `disk`).
STORAGE_DISK_BACKENDS = ("file", "disk")
_VLLM_SPLIT = (("local_cached_tokens", "device"), ("external_cached_tokens", "external"))


def _count(value: Any) -> int | None:
    """A token count: a non-negative int, not a bool."""
    return value if type(value) is int and value >= 0 else None


def _sglang(details: dict[str, Any]) -> dict[str, int] | None:
    """SGLang's per-tier details."""
    backend = details.get("storage_backend")
    storage = "disk" if isinstance(backend, str) and backend.lower() in STORAGE_DISK_BACKENDS else "external"
    tiers: dict[str, int] = {}
    for name, tier in (("device", "device"), ("host", "host"), ("storage", storage)):
        tokens = _count(details.get(name))
        if tokens is not None:
            tiers[tier] = tiers.get(tier, 0) + tokens
    return tiers or None


def tiers_from(obj: dict[str, Any], usage_details: Any) -> dict[str, int] | None:
    """The tiers one decoded answer (or stream event) names, None where it names none."""
    sglext = obj.get("sglext")
    details = sglext.get("cached_tokens_details") if isinstance(sglext, dict) else None
    if isinstance(details, dict):
        return _sglang(details)
    if isinstance(usage_details, dict):
        tiers = {tier: n for name, tier in _VLLM_SPLIT if (n := _count(usage_details.get(name))) is not None}
        return tiers or None
    return None
