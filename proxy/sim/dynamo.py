"""NVIDIA Dynamo dialect: the frontend over workers, `/clear_kv_blocks` that answers 200 whatever happened.

Each worker is one rank cache (`--dp-size` workers, round-robin). `/clear_kv_blocks` answers as
ai-dynamo/dynamo lib/llm/src/http/service/clear_kv_blocks.rs does: every worker it reaches goes
into `cleared_workers` with its answer serialised to a JSON string (a vLLM worker refuses while
its blocks are held: `{"status": "error", "message": "KV cache reset failed"}`,
components/src/dynamo/vllm/handlers.py), a worker it cannot reach (`--unreachable-worker`) into
`failed_workers`, and the HTTP status is 200 either way. `/health` lists `endpoints` and
`instances` (health.rs); there is no `/version`; model cards say `owned_by: "nvidia"`. The
frontend of the ai-dynamo 1.6.1 wheels answers 404 to `/clear_kv_blocks` (seen): `--no-reset-route`.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from proxy.sim.dialect import NullUsage, SimDialect
from proxy.sim.engine import Sequence
from proxy.sim.wire import json_body

__all__ = ["DynamoDialect"]

_NAMESPACE, _COMPONENT = "dynamo", "backend"
_ENDPOINT = f"{_NAMESPACE}/{_COMPONENT}/clear_kv_blocks"
# serde_json writes an object's keys sorted (its default map is a BTreeMap).
_CLEARED = orjson.dumps({"message": "KV cache cleared", "status": "success"}).decode()
_REFUSED = orjson.dumps({"message": "KV cache reset failed", "status": "error"}).decode()


class DynamoDialect(SimDialect):
    """The Dynamo frontend with its workers' caches (one per worker)."""

    name = "dynamo"
    null_usage = NullUsage.NEVER

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Per-request histograms' totals."""
        super().__init__(*args, **kwargs)
        self.requests = 0
        self.input_tokens = 0
        self.cached_tokens = 0

    async def restart(self, reconnect: bool = False) -> None:
        """Every worker's cache empty, the frontend's histograms at 0."""
        await super().restart(reconnect)
        self.requests = self.input_tokens = self.cached_tokens = 0

    def _instance(self, worker: int) -> str:
        """A worker instance's name as the frontend writes it."""
        return f"{_NAMESPACE}/{_COMPONENT}-instance-{worker + 1:x}"

    def route(self, request: web.Request, body: dict[str, Any], seq: Sequence) -> web.Response | None:
        """The KV router (`--router-mode kv`): the worker with the longest cached prefix, else round-robin."""
        hits = [cache.lookup(seq.prompt) if seq.cache_prompt else 0 for cache in self.rank_caches]
        best = max(hits)
        if best == 0:
            return super().route(request, body, seq)
        seq.rank = hits.index(best)
        return None

    def model_card_extras(self) -> dict[str, Any]:
        """The frontend's model cards (seen on ai-dynamo 1.6.1): `owned_by: "nvidia"`."""
        return {"owned_by": "nvidia", "context_window": 0}

    def not_found(self) -> web.Response:
        """The frontend's 404 (seen on ai-dynamo 1.6.1)."""
        return json_body({"message": "Route not found", "type": "Not Found", "code": 404}, 404)

    def prefilled(self, seq: Sequence) -> None:
        """Count the request in the frontend's histograms once its cached tokens are known."""
        super().prefilled(seq)
        self.requests += 1
        self.input_tokens += seq.prompt_tokens
        self.cached_tokens += seq.cached

    def add_routes(self, app: web.Application) -> None:
        """The frontend's health routes and its clear."""
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/live", self.handle_live)
        if self.config.reset_route:
            app.router.add_post("/clear_kv_blocks", self.handle_clear)

    async def handle_health(self, request: web.Request) -> web.Response:
        """GET /health: healthy, with the discovered endpoints and instances (ai-dynamo 1.6.1's shape)."""
        workers = [
            {"component": _COMPONENT, "endpoint": "generate", "namespace": _NAMESPACE, "instance_id": i + 1}
            for i in range(self.config.dp_size)
        ]
        endpoints = [f"dyn://{_NAMESPACE}.{_COMPONENT}.generate"]
        return json_body({"status": "healthy", "endpoints": endpoints, "instances": workers})

    async def handle_live(self, request: web.Request) -> web.Response:
        """GET /live."""
        return json_body({"status": "live", "message": "Service is live"})

    async def handle_clear(self, request: web.Request) -> web.Response:
        """POST /clear_kv_blocks: each worker's answer; 200 whatever they said."""
        cleared: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []
        busy = {seq.rank for seq in self.engine.running}
        self.engine.resets_total += 1
        for worker, cache in enumerate(self.rank_caches):
            entry: dict[str, Any] = {"name": self._instance(worker), "endpoint": _ENDPOINT}
            if worker == self.config.unreachable_worker:
                failed.append(
                    {**entry, "status": "Failed to send request for instance", "error": "connection refused"}
                )
                continue
            refused = worker in busy
            if not refused and not self.config.reset_leaves_warm:
                cache.clear()
            response = _REFUSED if refused else _CLEARED
            cleared.append(
                {**entry, "status": "Successfully cleared kv blocks for instance", "response": response}
            )
        return json_body({"cleared_workers": cleared, "failed_workers": failed})

    def metric_families(self) -> list[Metric]:
        """The frontend's dynamo_frontend_* families (dynamo/prometheus_names.py, frontend_service)."""
        model = self.config.served_model
        families: list[Metric] = []
        for name, doc, total in (
            ("dynamo_frontend_input_sequence_tokens", "Input sequence length in tokens", self.input_tokens),
            ("dynamo_frontend_cached_tokens", "Number of cached tokens per request", self.cached_tokens),
        ):
            family = HistogramMetricFamily(name, doc, labels=["model"])
            family.add_metric([model], [("+Inf", float(self.requests))], sum_value=float(total))
            families.append(family)
        requests = CounterMetricFamily(
            "dynamo_frontend_requests", "Total number of LLM requests", labels=["model"]
        )
        requests.add_metric([model], self.engine.requests_total)
        inflight = GaugeMetricFamily(
            "dynamo_frontend_inflight_requests", "Inflight requests", labels=["model"]
        )
        inflight.add_metric([model], len(self.engine.running))
        return [*families, requests, inflight]
