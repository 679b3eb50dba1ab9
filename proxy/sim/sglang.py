"""SGLang dialect: /flush_cache with ?timeout and admin key, /server_info, native /generate, sglang: metrics."""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from contextlib import aclosing
from typing import Any

import orjson
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.sim.cache import PrefixCache
from proxy.sim.dialect import NullUsage, SimDialect
from proxy.sim.engine import Sequence
from proxy.sim.kv_events import sglang_kv_events
from proxy.sim.text import PromptError
from proxy.sim.wire import DONE, error_response, read_json, send_event, sse_response

__all__ = ["SglangDialect"]

FLUSHED = "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"
FLUSH_FAILED = "Flush cache failed.\n"
FLUSH_IN_PROGRESS = "Another flush_cache is already in progress."
FLUSH_TIMEOUT = "Timed out waiting for idle state."
STORAGE_CLEARED = "Hierarchical cache storage backend cleared.\n"
MAX_FLUSH_TIMEOUT_S = 300.0


class SglangDialect(SimDialect):
    """SGLang 0.5.10+ with --enable-cache-report and --enable-metrics."""

    name = "sglang"
    # Chunks as SGLang's pydantic era wrote them (`model_dump_json()`): `"usage": null` on
    # every chunk, include_usage or not. Its msgspec encoder omits it: the sidecar strips
    # neither, as the null is never the injection's (observe/rules.py).
    null_usage = NullUsage.ALWAYS
    # Its scheduler's on_idle publishes pending KV events: a flush's AllBlocksCleared goes out at once.
    publishes_when_idle = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Add the single-flush guard."""
        super().__init__(*args, **kwargs)
        self._flushing = False
        # HiCache's storage tier (L3): written through on every prefill, untouched by /flush_cache,
        # and kept by a restart (a file or remote store outlives the process).
        storage = self.config.hicache_storage_backend
        self.storage = PrefixCache(self.config.block_size, self.config.cache_blocks) if storage else None
        self.cached_by_source: dict[str, int] = {}

    def lookup(self, seq: Sequence) -> int:
        """Device hits first, then the storage tier's longer prefix (prefetched back)."""
        device = super().lookup(seq)
        stored = self.storage.lookup(seq.prompt) if self.storage is not None and seq.cache_prompt else 0
        seq.cached_by_tier = {"device": device, "host": 0, "storage": max(0, stored - device)}
        for source, tokens in seq.cached_by_tier.items():
            self.cached_by_source[source] = self.cached_by_source.get(source, 0) + tokens
        return max(device, stored)

    async def restart(self, reconnect: bool = False) -> None:
        """Counters at 0, the per-tier ones too."""
        await super().restart(reconnect)
        self.cached_by_source = {}

    def parse_options(self, body: dict[str, Any], seq: Sequence) -> web.Response | None:
        """`return_cached_tokens_details` (SGLang #17648), honoured with --tier-details."""
        seq.tier_details = self.config.tier_details and body.get("return_cached_tokens_details") is True
        return None

    def _sglext(self, seq: Sequence) -> dict[str, Any]:
        """`sglext.cached_tokens_details` where the request asked for it."""
        if not seq.tier_details:
            return {}
        details: dict[str, Any] = dict(seq.cached_by_tier)
        if self.config.hicache_storage_backend is not None:
            details["storage_backend"] = self.config.hicache_storage_backend
        return {"sglext": {"cached_tokens_details": details}}

    def response_extras(self, seq: Sequence) -> dict[str, Any]:
        """A non-stream answer's `sglext`."""
        return self._sglext(seq)

    def finish_chunk_extras(self, seq: Sequence) -> dict[str, Any]:
        """A stream's `sglext`: SGLang sends it on a chunk of its own with no choices; here on the
        finish chunk, which has no usage either (the reader must find it by its own name)."""
        return self._sglext(seq)

    def prefilled(self, seq: Sequence) -> None:
        """Blocks go to the device cache and are backed up to the storage tier."""
        super().prefilled(seq)
        if self.storage is not None and seq.cache_prompt:
            self.storage.insert(seq.kv_tokens())

    def rank_hint(self, request: web.Request, body: dict[str, Any]) -> object:
        """The header (which wins, as SGLang's serving_base), else `routed_dp_rank`, else `data_parallel_rank`."""
        header = request.headers.get("X-Data-Parallel-Rank")
        if header is not None:
            return header
        for name in ("routed_dp_rank", "data_parallel_rank"):
            if body.get(name) is not None:
                return body[name]
        return None

    def add_routes(self, app: web.Application) -> None:
        """/health, /server_info, /get_server_info, /get_model_info, /flush_cache, /generate, /tokenize."""
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/health_generate", self.handle_health)
        app.router.add_get("/server_info", self.handle_server_info)
        app.router.add_get("/get_server_info", self.handle_server_info)
        app.router.add_get("/get_model_info", self.handle_model_info)
        app.router.add_route("GET", "/flush_cache", self.handle_flush)
        app.router.add_route("POST", "/flush_cache", self.handle_flush)
        app.router.add_post("/generate", self.handle_generate)
        app.router.add_post("/hicache/storage-backend/clear", self.handle_storage_clear)
        app.router.add_post("/tokenize", self.handle_tokenize)
        app.router.add_post("/v1/tokenize", self.handle_tokenize)

    async def handle_server_info(self, request: web.Request) -> web.Response:
        """GET /server_info (0.5.10+) and /get_server_info (0.4+): both carry `version`."""
        return web.json_response(
            {
                "version": self.config.engine_version,
                "model_path": self.config.served_model,
                "served_model_name": self.config.served_model,
                "page_size": self.config.hybrid_block_size or self.config.block_size,
                "max_running_requests": self.config.max_concurrency or None,
                "enable_cache_report": True,
                "dp_size": self.config.dp_size,
                "enable_hierarchical_cache": self.storage is not None,
                "hicache_storage_backend": self.config.hicache_storage_backend,
                "kv_events": sglang_kv_events(
                    self.kv_events, self.config.kv_events_discovery, self.config.dp_size
                ),
            }
        )

    async def handle_model_info(self, request: web.Request) -> web.Response:
        """GET /get_model_info."""
        return web.json_response({"model_path": self.config.served_model, "is_generation": True})

    def _authorized(self, request: web.Request) -> bool:
        """With --admin-api-key set, admin routes need `Authorization: Bearer KEY`."""
        key = self.config.admin_api_key
        if key is None:
            return True
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())

    async def handle_flush(self, request: web.Request) -> web.Response:
        """GET|POST /flush_cache[?timeout=S]: 200 when idle, 400 while running or waiting."""
        if not self._authorized(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        raw_timeout = request.query.get("timeout")
        timeout = 0.0
        if raw_timeout is not None:
            try:
                timeout = min(max(float(raw_timeout), 0.0), MAX_FLUSH_TIMEOUT_S)
            except ValueError:
                return web.Response(status=400, text="timeout must be a number of seconds\n")
        if self._flushing:
            return web.Response(status=400, text=FLUSH_IN_PROGRESS)
        self._flushing = True
        try:
            if timeout > 0 and not self.engine.is_idle():
                try:
                    await asyncio.wait_for(self.engine.wait_idle(), timeout)
                except TimeoutError:
                    return web.Response(status=400, text=FLUSH_TIMEOUT)
            # scheduler.flush_cache refuses unless no request is running or queued.
            if not self.engine.is_idle():
                return web.Response(status=400, text=FLUSH_FAILED)
            self.clear_cache()
            return web.Response(status=200, text=FLUSHED)
        finally:
            self._flushing = False

    async def handle_storage_clear(self, request: web.Request) -> web.Response:
        """POST /hicache/storage-backend/clear: 200 once cleared; 400 without a storage tier or while busy."""
        if not self._authorized(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        if self.storage is None or not self.engine.is_idle():
            return web.Response(status=400, text=STORAGE_CLEARED)  # SGLang's text, whatever the result
        self.storage.clear()
        return web.Response(status=200, text=STORAGE_CLEARED)

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        """POST /generate: SGLang's native route, `meta_info.cached_tokens` always."""
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        try:
            if "input_ids" in body and body["input_ids"] is not None:
                prompt = self.template.completion(body["input_ids"])
            else:
                prompt = self.template.completion(body.get("text"))
        except PromptError:
            return error_response(400, "'text' must be a string or 'input_ids' a list of token ids")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            return error_response(400, "'sampling_params' must be an object")
        max_new = params.get("max_new_tokens", self.config.default_max_tokens)
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
            return error_response(400, "'max_new_tokens' must be a non-negative integer")
        seq = Sequence(prompt=prompt, max_tokens=max_new)
        rid = body.get("rid") if isinstance(body.get("rid"), str) else uuid.uuid4().hex
        started = time.perf_counter()

        def meta(finished: bool) -> dict[str, Any]:
            """SGLang's meta_info."""
            return {
                "id": rid,
                "finish_reason": {"type": "length", "length": seq.completion_tokens} if finished else None,
                "prompt_tokens": seq.prompt_tokens,
                "completion_tokens": seq.completion_tokens,
                "cached_tokens": seq.cached,
                "e2e_latency": time.perf_counter() - started,
            }

        async with self.engine.session(seq):
            await self.engine.prefill(seq)
            if body.get("stream") is not True:
                await self.engine.generate(seq)
                return web.Response(
                    body=orjson.dumps({"text": seq.text, "meta_info": meta(True)}),
                    content_type="application/json",
                )
            resp = await sse_response(request)
            async with aclosing(self.engine.decode(seq)) as tokens:
                async for _ in tokens:
                    # SGLang's native stream carries the cumulative text in each event.
                    await send_event(
                        resp, {"text": seq.text, "meta_info": meta(seq.completion_tokens == seq.max_tokens)}
                    )
            if seq.max_tokens == 0:
                await send_event(resp, {"text": "", "meta_info": meta(True)})
            await resp.write(DONE)
            await resp.write_eof()
            return resp

    def metric_families(self) -> list[Metric]:
        """sglang: families of --enable-metrics."""
        engine, model = self.engine, self.config.served_model
        by_source = self.config.tier_details
        cached = CounterMetricFamily(
            "sglang:cached_tokens",
            "Number of cached prompt tokens.",
            labels=["model_name", "cache_source"] if by_source else ["model_name"],
        )
        if by_source:
            for source, tokens in self.cached_by_source.items():
                cached.add_metric([model, source], tokens)
        else:
            cached.add_metric([model], engine.cached_tokens_total)
        prompt = CounterMetricFamily(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", labels=["model_name"]
        )
        prompt.add_metric([model], engine.prompt_tokens_total)
        requests = CounterMetricFamily(
            "sglang:num_requests", "Number of requests processed.", labels=["model_name"]
        )
        requests.add_metric([model], engine.requests_total)
        gen = CounterMetricFamily(
            "sglang:generation_tokens", "Number of generation tokens processed.", labels=["model_name"]
        )
        gen.add_metric([model], engine.generation_tokens_total)
        running = GaugeMetricFamily(
            "sglang:num_running_reqs", "The number of running requests.", labels=["model_name"]
        )
        running.add_metric([model], len(engine.running))
        queue = GaugeMetricFamily(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue.", labels=["model_name"]
        )
        queue.add_metric([model], engine.waiting)
        rate = GaugeMetricFamily("sglang:cache_hit_rate", "The prefix cache hit rate.", labels=["model_name"])
        rate.add_metric(
            [model],
            engine.cached_tokens_total / engine.prompt_tokens_total if engine.prompt_tokens_total else 0.0,
        )
        return [cached, prompt, requests, gen, running, queue, rate]
