"""TensorRT-LLM dialect: trtllm-serve's routes, its JSON `/metrics` and Prometheus `/prometheus/metrics`.

As tensorrt_llm/serve/openai_server.py (register_routes) serves them: `/health` 200 with no
body, `/version`, `/v1/models` owned by `tensorrt_llm`, `/metrics` the JSON iteration stats,
`/server_info` without a version, `/prometheus/metrics` only with `return_perf_metrics`, and
`/reset_prefix_cache` where the release has it (#14970, reverted; #15313), answered as vLLM's.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.sim.dialect import NullUsage, SimDialect
from proxy.sim.wire import json_body

__all__ = ["TrtllmDialect"]

# MetricsCollector's labels as openai_server.py creates it.
_LABELS = ("model_name", "engine_type")
_VALUES = ("undefined", "undefined")


class _Families(Collector):
    """Reads the dialect's Prometheus families at scrape time."""

    def __init__(self, dialect: TrtllmDialect) -> None:
        """Collect from one dialect."""
        self.dialect = dialect

    def collect(self) -> Any:
        """Yield the current families."""
        yield from self.dialect.prometheus_families()


class TrtllmDialect(SimDialect):
    """trtllm-serve (PyTorch backend) with KV cache reuse on."""

    name = "trtllm"
    null_usage = NullUsage.NEVER

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The Prometheus registry of /prometheus/metrics."""
        super().__init__(*args, **kwargs)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Families(self))

    def model_card_extras(self) -> dict[str, Any]:
        """ModelCard's default owner (openai_protocol.py)."""
        return {"owned_by": "tensorrt_llm"}

    def add_routes(self, app: web.Application) -> None:
        """trtllm-serve's routes besides inference."""
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/health_generate", self.handle_health)
        app.router.add_get("/version", self.handle_version)
        app.router.add_get("/metrics", self.handle_stats)
        app.router.add_get("/server_info", self.handle_server_info)
        app.router.add_post("/kv_cache_events", self.handle_events)
        if self.config.reset_route:
            app.router.add_post("/reset_prefix_cache", self.handle_reset)
        if self.config.perf_metrics:
            app.router.add_get("/prometheus/metrics", self.handle_prometheus)

    async def handle_version(self, request: web.Request) -> web.Response:
        """GET /version: `{"version"}`, the shape of vLLM's."""
        return json_body({"version": self.config.engine_version})

    async def handle_server_info(self, request: web.Request) -> web.Response:
        """GET /server_info: the disaggregated params only (no version: not SGLang's)."""
        return json_body({"disaggregated_params": None})

    async def handle_events(self, request: web.Request) -> web.Response:
        """POST /kv_cache_events: the drained queue (events are not simulated)."""
        return json_body([])

    async def handle_stats(self, request: web.Request) -> web.Response:
        """GET /metrics: a JSON list of iteration stats, not the exposition format."""
        engine = self.engine
        stat = {
            "iter": engine.requests_total,
            "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
            "numActiveRequests": len(engine.running),
            "kvCacheStats": {"reusedBlocks": engine.cached_tokens_total // self.config.block_size},
        }
        return json_body([stat])

    async def handle_prometheus(self, request: web.Request) -> web.Response:
        """GET /prometheus/metrics: the MetricsCollector families."""
        self.engine.metrics_scrapes_total += 1
        return web.Response(
            body=generate_latest(self.registry),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def handle_reset(self, request: web.Request) -> web.Response:
        """POST /reset_prefix_cache: refused while a request holds blocks, as vLLM's."""
        success = not self.engine.running
        if success:
            self.clear_cache()
        return json_body({"success": success})

    def prometheus_families(self) -> list[Metric]:
        """The counters the sidecar's witnesses read (tensorrt_llm/metrics/collector.py)."""
        engine = self.engine
        families: list[Metric] = []
        for name, doc, value in (
            ("trtllm_request_success", "Count of successfully processed requests.", engine.completed_total),
            ("trtllm_prompt_tokens", "Cumulative number of prompt tokens.", engine.prompt_tokens_total),
            (
                "trtllm_prompt_cached_tokens",
                "Prompt tokens served from KV cache.",
                engine.cached_tokens_total,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(_VALUES, value)
            families.append(family)
        by_level = CounterMetricFamily(
            "trtllm_prompt_cache_hit_tokens",
            "Prompt tokens served from each KV cache level.",
            labels=(*_LABELS, "cache_level", "cache_tier"),
        )
        by_level.add_metric((*_VALUES, "0", "gpu"), engine.cached_tokens_total)
        families.append(by_level)
        running = GaugeMetricFamily(
            "trtllm_num_requests_running", "Number of active requests", labels=_LABELS
        )
        running.add_metric(_VALUES, len(engine.running))
        families.append(running)
        return families
