"""The base dialect: what every simulated engine shares, with hooks for each one's rules."""

from __future__ import annotations

from dataclasses import replace
from enum import StrEnum
from typing import Any

from aiohttp import web
from prometheus_client.core import Metric

from proxy.sim.cache import PrefixCache
from proxy.sim.config import SimConfig
from proxy.sim.engine import Engine, Sequence
from proxy.sim.kv_events import KvEventPublisher
from proxy.sim.scheduler import Scheduler
from proxy.sim.text import CHATML, ChatTemplate, PromptError, piece_tokenize, token_ids
from proxy.sim.wire import error_response, json_body, read_json

__all__ = ["NullUsage", "SimDialect"]


class NullUsage(StrEnum):
    """When an engine writes `"usage": null` on stream chunks that carry no usage."""

    WITH_INCLUDE_USAGE = "with_include_usage"  # OpenAI: once include_usage is on
    ALWAYS = "always"  # SGLang's pydantic era: `model_dump_json()` writes every field
    NEVER = "never"  # vLLM 0.32, SGLang's msgspec encoder (omit_defaults)


class SimDialect:
    """An OpenAI-compatible engine with a block prefix cache and no reset endpoint.

    Subclasses override the hooks for their engine's rules; this base is the
    plain `openai` dialect.
    """

    name = "openai"
    # vLLM answers 400 to stream_options without stream; the others ignore it.
    rejects_stream_options_without_stream = False
    # llama.cpp puts /v1/completions usage on the finish chunk, not a usage-only chunk.
    completions_usage_on_finish_chunk = False
    # OpenAI writes `"usage": null` on every other chunk once include_usage is on.
    null_usage = NullUsage.WITH_INCLUDE_USAGE
    # How messages and prompts become tokens.
    template: ChatTemplate = CHATML
    # SGLang's scheduler publishes its KV events when idle too; vLLM's only at the end of an
    # engine step, so a reset's AllBlocksCleared waits for the next request.
    publishes_when_idle = False

    def __init__(self, config: SimConfig) -> None:
        """Build this dialect's engine, with this dialect as its hooks, and the prefix cache."""
        self.config = config
        if config.word_pieces:
            self.template = replace(self.template, tokenize=piece_tokenize)
        self.engine = Engine(config, self)
        self.cache = PrefixCache(self.config.block_size, self.config.cache_blocks)
        # One cache per data-parallel rank; rank 0's is `cache` (the one the KV events follow).
        self.rank_caches = [self.cache] + [
            PrefixCache(self.config.block_size, self.config.cache_blocks) for _ in range(config.dp_size - 1)
        ]
        self._next_rank = 0
        self.kv_events = self._kv_publisher()
        self.cache.listener = self.kv_events
        self._places: Scheduler | None = (
            Scheduler(self.config.max_concurrency, by_priority=self.config.scheduling_policy == "priority")
            if self.config.max_concurrency
            else None
        )

    def _kv_publisher(self) -> KvEventPublisher | None:
        """The KV events publisher that --kv-events-endpoint asks for."""
        config, fmt = self.config, self.config.kv_events_format
        if fmt is None or config.kv_events_endpoint is None:
            return None
        return KvEventPublisher(
            fmt,
            config.kv_events_endpoint,
            config.kv_events_replay,
            topic=config.kv_events_topic,
            rank=config.kv_events_rank,
            block_size=config.block_size,
            drop_every=config.kv_events_drop_every,
        )

    def end_step(self) -> None:
        """An engine step ended: publish its KV events as one batch."""
        if self.kv_events is not None:
            self.kv_events.flush()

    async def restart(self, reconnect: bool = False) -> None:
        """What a restart of the engine process shows: an empty cache, counters and the events' seq at 0.

        Nothing is published for it (a restarted engine says nothing); `reconnect` also reopens
        the event sockets, as a new process has new ones.
        """
        self.engine.restart()
        self.cache.listener = None
        for cache in self.rank_caches:
            cache.clear()
        self.cache.listener = self.kv_events
        if self.kv_events is not None:
            self.kv_events.forget()
            if reconnect:
                await self.kv_events.reconnect()

    # -- scheduling hooks ------------------------------------------------------------------
    async def admit(self, seq: Sequence) -> None:
        """Wait for a running place under --max-concurrency (the wait counts as waiting)."""
        if self._places is None:
            return
        if self._places.try_enter():
            return
        self.engine.waiting += 1
        self.engine.state_changed()
        try:
            await self._places.enter(seq.priority)
        finally:
            self.engine.waiting -= 1

    def release(self, seq: Sequence, completed: bool) -> None:
        """Give back the running place; the KV computed so far stays cached (as vLLM frees blocks to the cache)."""
        if self._places is not None:
            self._places.leave()
        if seq.cache_prompt:
            self.cache_of(seq).insert(seq.kv_tokens() if seq.reuse_generated_state else seq.prompt)
        self.end_step()

    def lookup(self, seq: Sequence) -> int:
        """Cached prompt tokens for a sequence about to prefill."""
        if not seq.cache_prompt:
            return 0
        hit = self.cache_of(seq).lookup(seq.prompt)
        hybrid = self.config.hybrid_block_size
        # A hybrid model's recurrent state is saved every `hybrid` tokens only: hits land there.
        return hit - hit % hybrid if hybrid else hit

    def prefilled(self, seq: Sequence) -> None:
        """The prompt's KV exists now: its full blocks become hits for later requests."""
        if seq.cache_prompt:
            self.cache_of(seq).insert(seq.kv_tokens())
        self.end_step()

    def decoded(self, seq: Sequence, token: str) -> None:
        """One token was generated (llama.cpp's slot grows)."""

    def parse_options(self, body: dict[str, Any], seq: Sequence) -> web.Response | None:
        """Read dialect-specific request fields into the sequence; an error answer if bad."""
        return None

    # -- data parallelism ------------------------------------------------------------------
    def cache_of(self, seq: Sequence) -> PrefixCache:
        """The prefix cache of the rank `seq` runs on."""
        return self.rank_caches[seq.rank]

    def rank_hint(self, request: web.Request, body: dict[str, Any]) -> object:
        """The request's data-parallel routing hint: vLLM's `X-data-parallel-rank` header."""
        return request.headers.get("X-data-parallel-rank")

    def route(self, request: web.Request, body: dict[str, Any], seq: Sequence) -> web.Response | None:
        """Put `seq` on the rank its hint names, else the next one round-robin; 400 for a bad rank."""
        size = self.config.dp_size
        if size == 1:
            return None
        hint = self.rank_hint(request, body)
        if hint is None:
            seq.rank, self._next_rank = self._next_rank, (self._next_rank + 1) % size
            return None
        text = str(hint).strip()
        if isinstance(hint, bool) or not text.isdigit() or int(text) >= size:
            return error_response(400, f"data parallel rank must be 0 .. {size - 1}, not {text[:20]!r}")
        seq.rank = int(text)
        return None

    # -- response hooks --------------------------------------------------------------------
    def usage(self, seq: Sequence) -> dict[str, Any]:
        """The `usage` object, with this dialect's cached-token field."""
        return {
            "prompt_tokens": seq.prompt_tokens,
            "total_tokens": seq.prompt_tokens + seq.completion_tokens,
            "completion_tokens": seq.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": seq.cached},
        }

    def response_extras(self, seq: Sequence) -> dict[str, Any]:
        """Top-level members added to a non-stream response."""
        return {}

    def usage_chunk_extras(self, seq: Sequence) -> dict[str, Any]:
        """Top-level members added to the include_usage chunk."""
        return {}

    def last_event_extras(self, seq: Sequence) -> dict[str, Any]:
        """Top-level members added to the stream's last data event, whichever chunk that is."""
        return {}

    def finish_chunk_extras(self, seq: Sequence) -> dict[str, Any]:
        """Top-level members added to the chunk that carries finish_reason."""
        return {}

    def cancelled_response(self, seq: Sequence) -> web.Response:
        """Answer to a non-stream request cancelled inside the engine."""
        return error_response(409, "request cancelled", "cancelled")

    # -- routes and introspection ----------------------------------------------------------
    def add_routes(self, app: web.Application) -> None:
        """Register this dialect's own routes."""
        app.router.add_get("/health", self.handle_health)

    async def handle_health(self, request: web.Request) -> web.Response:
        """Health probe: 200 with an empty body, as vLLM's."""
        return web.Response(status=200)

    async def handle_tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize as vLLM and SGLang answer it: `prompt` (vLLM: or `messages`) → count and ids.

        The count is the one the chat and completion routes use, so a caller can size a prompt
        by it. vLLM's `messages` form counts the chat template too; `add_special_tokens` changes
        nothing here (the simulated tokenizer adds no BOS).
        """
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        try:
            if "messages" in body and self.name == "vllm":
                tokens = self.template.chat(body["messages"])
            elif isinstance(body.get("prompt"), str):
                tokens = self.template.tokenize(body["prompt"])
            else:
                raise PromptError("'prompt' must be a string")
        except PromptError as exc:
            return error_response(400, str(exc))
        return json_body({"count": len(tokens), "max_model_len": 4096, "tokens": token_ids(tokens)})

    def not_found(self) -> web.Response:
        """The 404 of an unknown route (FastAPI's body: vLLM, SGLang and most OpenAI servers)."""
        return json_body({"detail": "Not Found"}, 404)

    def model_card_extras(self) -> dict[str, Any]:
        """Extra members of this dialect's `/v1/models` entries."""
        return {}

    def metrics_answer(self, request: web.Request) -> web.Response | None:
        """An answer to `/metrics` other than the metrics (a router's 400), None for the metrics."""
        return None

    def metric_families(self) -> list[Metric]:
        """Prometheus families of this dialect's `/metrics`; empty = no route."""
        return []

    def stats(self) -> dict[str, object]:
        """Dialect-specific members of `/sim/stats`."""
        stats: dict[str, object] = {"cache_blocks": len(self.cache)}
        if self.config.dp_size > 1:
            stats["rank_cache_blocks"] = [len(cache) for cache in self.rank_caches]
        if self.kv_events is not None:
            stats.update(self.kv_events.stats())
        return stats

    def clear_cache(self) -> int:
        """Drop the whole prefix cache and count a reset (with --reset-leaves-warm: count it only)."""
        self.engine.resets_total += 1
        if self.config.reset_leaves_warm:
            return 0  # the blocks stay, so no event says they went
        dropped = 0
        for rank, cache in enumerate(self.rank_caches):
            if rank != self.config.refusing_rank:
                dropped += cache.clear()
        if self.publishes_when_idle:
            self.end_step()
        return dropped
