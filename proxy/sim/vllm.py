"""vLLM dialect: /version, /reset_prefix_cache (dev mode), vllm: metrics, cached-token options."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from proxy.sim.cache import PrefixCache
from proxy.sim.config import SimConfig
from proxy.sim.dialect import NullUsage, SimDialect
from proxy.sim.engine import Sequence
from proxy.sim.kv_events import kv_event_sources
from proxy.sim.lmcache import LmcacheTier
from proxy.sim.wire import error_response

__all__ = ["VllmDialect"]


class VllmDialect(SimDialect):
    """vLLM's OpenAI server as of 0.32, with switches for older behaviours."""

    name = "vllm"
    rejects_stream_options_without_stream = True
    # Seen on the real 0.32 server: no `"usage": null` members on stream chunks under include_usage.
    null_usage = NullUsage.NEVER
    # vLLM's `source` labels of prompt_tokens_cached_by_source (0.32 publishes them all).
    sources = ("device", "host", "p2p", "disk", "external_unspecified")

    def __init__(self, config: SimConfig) -> None:
        """The device cache, and with --host-tier an offload tier that resets leave warm."""
        super().__init__(config)
        self.host = PrefixCache(config.block_size, config.cache_blocks) if config.host_tier else None
        # LMCache's tier (a KV connector): /reset_prefix_cache does not reach it, its own API does.
        self.lmcache = LmcacheTier(config) if config.lmcache else None
        self.cached_by_source = self._no_hits()
        self.sleeping = False

    def _no_hits(self) -> list[dict[str, int]]:
        """Cached tokens by source, per data-parallel rank (each its own `engine` label), all 0."""
        return [dict.fromkeys(self.sources, 0) for _ in range(self.config.dp_size)]

    def lookup(self, seq: Sequence) -> int:
        """Device hits first, then the host tier's and LMCache's longer prefixes (each counted by source)."""
        device = super().lookup(seq)
        host = self.host.lookup(seq.prompt) if self.host is not None and seq.cache_prompt else 0
        local = max(device, host)
        external = self.lmcache.lookup(seq.prompt) if self.lmcache is not None and seq.cache_prompt else 0
        self.cached_by_source[seq.rank]["device"] += device
        self.cached_by_source[seq.rank]["host"] += max(0, host - device)
        self.cached_by_source[seq.rank]["external_unspecified"] += max(0, external - local)
        if self.lmcache is not None:
            self.lmcache.hit_tokens += max(0, external - local)
        return max(local, external)

    def prefilled(self, seq: Sequence) -> None:
        """Blocks go to the device cache and are offloaded to the host tier and LMCache."""
        super().prefilled(seq)
        if self.host is not None and seq.cache_prompt:
            self.host.insert(seq.kv_tokens())
        if self.lmcache is not None and seq.cache_prompt:
            self.lmcache.store(seq.kv_tokens())

    async def restart(self, reconnect: bool = False) -> None:
        """Every tier empty, counters at 0."""
        await super().restart(reconnect)
        self.cached_by_source = self._no_hits()
        self.sleeping = False
        if self.host is not None:
            self.host.clear()
        if self.lmcache is not None:
            self.lmcache.forget()

    def stats(self) -> dict[str, object]:
        """`/sim/stats`, with LMCache's clears and each worker's shard size."""
        stats = super().stats()
        if self.lmcache is not None:
            stats["lmcache_clears"] = self.lmcache.clears
            stats["lmcache_blocks"] = [len(shard) for shard in self.lmcache.shards]
        return stats

    def last_event_extras(self, seq: Sequence) -> dict[str, Any]:
        """vLLM 0.32 puts `system_fingerprint` on a stream's last chunk (the usage chunk if any)."""
        return {"system_fingerprint": f"vllm-{self.config.engine_version}-sim"}

    def parse_options(self, body: dict[str, Any], seq: Sequence) -> web.Response | None:
        """`priority` (lower runs earlier under --scheduling-policy priority; vLLM's request field)."""
        priority = body.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            return error_response(400, "'priority' must be an integer")
        seq.priority = priority
        return None

    def usage(self, seq: Sequence) -> dict[str, Any]:
        """Usage; the cached field needs --enable-prompt-tokens-details, and <= 0.14 omitted a 0."""
        usage: dict[str, Any] = {
            "prompt_tokens": seq.prompt_tokens,
            "total_tokens": seq.prompt_tokens + seq.completion_tokens,
            "completion_tokens": seq.completion_tokens,
        }
        if self.config.prompt_tokens_details and not (self.config.omit_zero_cached and seq.cached == 0):
            usage["prompt_tokens_details"] = {"cached_tokens": seq.cached}
        return usage

    def model_card_extras(self) -> dict[str, Any]:
        """vLLM's model card members."""
        return {"root": self.config.served_model, "parent": None, "max_model_len": 4096}

    def add_routes(self, app: web.Application) -> None:
        """/health, /ping, /version, /tokenize, and /reset_prefix_cache only in dev mode."""
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/ping", self.handle_health)
        app.router.add_post("/ping", self.handle_health)
        app.router.add_get("/version", self.handle_version)
        app.router.add_post("/tokenize", self.handle_tokenize)
        # 0.32 serves it without dev mode (entrypoints/serve/instrumentator/basic.py).
        app.router.add_get("/kv_event_sources", self.handle_kv_event_sources)
        if self.config.dev_mode:
            # Registered only under VLLM_SERVER_DEV_MODE=1
            # (vllm/entrypoints/serve/dev/cache/api_router.py); else FastAPI's 404.
            app.router.add_post("/reset_prefix_cache", self.handle_reset)
            # Sleep mode's dev routes (vllm/entrypoints/serve/dev): level 1 drops the KV cache.
            app.router.add_post("/sleep", self.handle_sleep)
            app.router.add_post("/wake_up", self.handle_wake)
            app.router.add_get("/is_sleeping", self.handle_is_sleeping)
            # The multi-modal and encoder caches (a text-only model has neither): 200, empty
            # body; `vllm bench sweep` posts all three after each run.
            app.router.add_post("/reset_mm_cache", self.handle_other_reset)
            app.router.add_post("/reset_encoder_cache", self.handle_other_reset)

    async def handle_sleep(self, request: web.Request) -> web.Response:
        """POST /sleep: the KV cache is discarded."""
        self.sleeping = True
        for cache in self.rank_caches:
            cache.clear()
        return web.Response(status=200)

    async def handle_wake(self, request: web.Request) -> web.Response:
        """POST /wake_up."""
        self.sleeping = False
        return web.Response(status=200)

    async def handle_is_sleeping(self, request: web.Request) -> web.Response:
        """GET /is_sleeping."""
        return web.json_response({"is_sleeping": self.sleeping})

    async def handle_other_reset(self, request: web.Request) -> web.Response:
        """POST /reset_mm_cache, /reset_encoder_cache: nothing to clear, 200 with no body."""
        return web.Response(status=200)

    async def handle_kv_event_sources(self, request: web.Request) -> web.Response:
        """GET /kv_event_sources: the publisher of each rank (with --kv-events-discovery), else {}."""
        return web.json_response(kv_event_sources(self.kv_events, self.config.kv_events_discovery))

    async def handle_version(self, request: web.Request) -> web.Response:
        """GET /version; the Rust front end adds `rust_frontend_version` (vllm #43854)."""
        version: dict[str, str] = {"version": self.config.engine_version}
        if self.config.rust_frontend is not None:
            version["rust_frontend_version"] = f"{self.config.engine_version}-rs-sim"
        return web.json_response(version)

    async def handle_reset(self, request: web.Request) -> web.Response:
        """POST /reset_prefix_cache[?reset_running_requests=true&reset_external=true]."""
        force = request.query.get("reset_running_requests", "").lower() in ("true", "1")
        # reset_external only matters with a KV connector/offload tier, which the sim has not.
        if force:
            # vLLM 0.12+ preempts running requests (their blocks go free) and they are
            # recomputed afterwards; they are not failed.
            for seq in self.engine.running:
                seq.preempted = True
        # block_pool.reset_prefix_cache refuses while any block is held by a running request.
        held = any(not seq.preempted for seq in self.engine.running)
        success = not held
        rust = self.config.rust_frontend
        external = request.query.get("reset_external", "").lower() in ("true", "1")
        if rust == "strict" and external and self.host is None and self.lmcache is None:  # no connector
            return error_response(400, "reset_external requires a KV connector to be configured")
        if success:
            self.clear_cache()
        if rust == "strict" and not success:
            return error_response(409, "prefix cache reset refused: blocks are still in use", "conflict")
        if self.config.legacy_empty_body or rust is not None:
            # vLLM 0.7-0.25, and the Rust front end: 200 with an empty body whatever happened.
            return web.Response(status=200)
        return web.json_response({"success": success})

    def metric_families(self) -> list[Metric]:
        """vllm: families read by dashboards (names of vLLM 0.25+)."""
        engine, model = self.engine, self.config.served_model
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels=["model_name"],
        )
        queries.add_metric([model], engine.prompt_tokens_total)
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels=["model_name"],
        )
        hits.add_metric([model], engine.cached_tokens_total)
        cached = CounterMetricFamily(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local prefix cache).",
            labels=["model_name"],
        )
        cached.add_metric([model], engine.cached_tokens_total)
        prompt = CounterMetricFamily(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels=["model_name"]
        )
        prompt.add_metric([model], engine.prompt_tokens_total)
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_cached_by_source",
            "Number of cached prompt tokens by source.",
            labels=["model_name", "engine", "source"],
        )
        for rank, counts in enumerate(self.cached_by_source):
            for source, tokens in counts.items():
                by_source.add_metric([model, str(rank), source], tokens)
        # One bucket is enough for the count: requests whose prompt was processed.
        request_prompt = HistogramMetricFamily(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            labels=["model_name"],
        )
        request_prompt.add_metric(
            [model], [("+Inf", float(engine.requests_total))], sum_value=float(engine.prompt_tokens_total)
        )
        gen = CounterMetricFamily(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels=["model_name"]
        )
        gen.add_metric([model], engine.generation_tokens_total)
        running = GaugeMetricFamily(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels=["model_name"],
        )
        running.add_metric([model], len(engine.running))
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=["model_name"]
        )
        waiting.add_metric([model], engine.waiting)
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=["model_name"]
        )
        usage.add_metric(
            [model], len(self.cache) / self.config.cache_blocks if self.config.cache_blocks else 0.0
        )
        # vLLM publishes its cache settings as labels of an info gauge (v1/metrics/loggers.py).
        cache_config = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "enable_prefix_caching",
                "num_gpu_blocks",
                "mamba_block_size",
                "cache_hit_alignment_tokens",
            ],
        )
        # vLLM 0.32 writes every CacheConfig field as str(value): "None" where unset.
        hybrid = str(self.config.hybrid_block_size)
        alignment = hybrid if self.config.hybrid_block_size else str(self.config.block_size)
        cache_config.add_metric(
            [str(self.config.block_size), "True", str(self.config.cache_blocks), hybrid, alignment], 1.0
        )
        families: list[Metric] = [
            queries,
            hits,
            cached,
            prompt,
            by_source,
            request_prompt,
            gen,
            running,
            waiting,
            usage,
            cache_config,
        ]
        if self.lmcache is not None:
            # LMCache's own counters, on vLLM's /metrics (lmcache/observability.py).
            lmcache_hits = CounterMetricFamily(
                "lmcache:num_hit_tokens", "Total number of tokens hit in lmcache", labels=["model_name"]
            )
            lmcache_hits.add_metric([model], self.lmcache.hit_tokens)
            families.append(lmcache_hits)
        return families
