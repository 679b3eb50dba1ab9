"""llama.cpp `llama-server` dialect: slots with their own KV (llamacpp_slots.py), RAM prompt cache."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import aclosing
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.sim.engine import Sequence
from proxy.sim.llamacpp_modes import IdleSleep, router_props, without_model
from proxy.sim.llamacpp_slots import N_CTX, SlotsDialect, llama_error
from proxy.sim.text import PromptError, common_prefix, token_ids
from proxy.sim.wire import (
    json_body,
    read_json,
    send_event,
    sse_response,
)

__all__ = ["LlamacppDialect"]

RAM_CACHE_ENTRIES = 64


class LlamacppDialect(SlotsDialect):
    """llama-server with `-np N --metrics --slots`, optionally `--slot-save-path` and RAM cache."""

    name = "llamacpp"
    completions_usage_on_finish_chunk = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Make the slots and the RAM prompt cache."""
        super().__init__(*args, **kwargs)
        self.ram: OrderedDict[tuple[str, ...], None] = OrderedDict()
        self.idle = IdleSleep(self.config.sleep_idle_seconds, self._unload)

    def _unload(self) -> None:
        """Sleep: the model and its KV are gone (every slot, the RAM prompt cache); no reset is counted."""
        for slot in self.slots:
            slot.tokens = []
        self.ram.clear()

    def _task(self) -> None:
        """A task reached the server: it wakes if asleep."""
        self.idle.task(busy=bool(self.engine.running))

    # -- admitting a request to a slot -----------------------------------------------------
    async def admit(self, seq: Sequence) -> None:
        """Take the pinned slot (`id_slot`) or any free one; defer while none is free."""
        self._task()
        slot = self.slots[seq.id_slot] if seq.id_slot >= 0 else await self._wait_free(seq)
        await self._take(slot)
        slot.processing = True
        seq.slot = slot.id

    def release(self, seq: Sequence, completed: bool) -> None:
        """Free the slot; it keeps prompt + generation, and the RAM cache gets a copy."""
        slot = self.slots[seq.slot]
        slot.processing = False
        slot.last_used = next(self._clock)
        self._task()  # the idle clock starts at the end of the last task
        if self.config.ram_cache and slot.tokens:
            self._ram_save(slot.tokens)
        self._give(slot)

    def _ram_save(self, tokens: list[str]) -> None:
        """Keep a prompt in the host-RAM cache (LRU by entries)."""
        key = tuple(tokens)
        self.ram[key] = None
        self.ram.move_to_end(key)
        while len(self.ram) > RAM_CACHE_ENTRIES:
            self.ram.popitem(last=False)

    def parse_options(self, body: dict[str, Any], seq: Sequence) -> web.Response | None:
        """`id_slot` (pin; -1 any) and `cache_prompt`."""
        id_slot = body.get("id_slot", -1)
        if isinstance(id_slot, bool) or not isinstance(id_slot, int) or id_slot >= len(self.slots):
            return llama_error(400, f"id_slot must be an integer below {len(self.slots)}, or -1")
        seq.id_slot = id_slot
        cache_prompt = body.get("cache_prompt", True)
        if not isinstance(cache_prompt, bool):
            return llama_error(400, "cache_prompt must be a boolean")
        seq.cache_prompt = cache_prompt
        return None

    def lookup(self, seq: Sequence) -> int:
        """Reuse the slot's common prefix (or a better RAM entry); the last prompt token is always recomputed."""
        slot = self.slots[seq.slot]
        if not seq.cache_prompt:
            slot.tokens = []
            return 0
        reuse = common_prefix(slot.tokens, seq.prompt)
        if self.config.ram_cache:
            # --cache-ram: the server loads the best-matching cached prompt into the slot.
            for entry in self.ram:
                n = common_prefix(entry, seq.prompt)
                if n > reuse:
                    reuse = n
                    slot.tokens = list(entry)
        return max(0, min(reuse, seq.prompt_tokens - 1))

    def prefilled(self, seq: Sequence) -> None:
        """The slot's KV now is the prompt."""
        slot = self.slots[seq.slot]
        slot.tokens = seq.kv_tokens()
        slot.n_prompt_tokens = seq.prompt_tokens

    def decoded(self, seq: Sequence, token: str) -> None:
        """The slot's KV grows by each generated token."""
        self.slots[seq.slot].tokens.append(token.strip())

    async def restart(self, reconnect: bool = False) -> None:
        """A restart empties the slots and the RAM cache too."""
        await super().restart(reconnect)
        self.clear_cache()
        self.engine.resets_total = 0
        self.ram.clear()

    def clear_cache(self) -> int:
        """Erase every slot (the RAM cache stays: no endpoint clears it)."""
        self.engine.resets_total += 1
        n = sum(len(s.tokens) for s in self.slots)
        for slot in self.slots:
            slot.tokens = []
        return n

    # -- responses -------------------------------------------------------------------------
    def timings(self, seq: Sequence) -> dict[str, Any]:
        """llama-server's `timings` object."""
        prompt_n = seq.prompt_tokens - seq.cached
        prompt_ms = seq.prefill_s * 1000.0
        predicted_n = seq.completion_tokens
        predicted_ms = seq.decode_s * 1000.0
        return {
            "cache_n": seq.cached,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / seq.prefill_s if seq.prefill_s > 0 else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": predicted_n / seq.decode_s if seq.decode_s > 0 else 0.0,
        }

    def response_extras(self, seq: Sequence) -> dict[str, Any]:
        """Non-stream responses carry `timings`."""
        return {"timings": self.timings(seq)}

    def last_event_extras(self, seq: Sequence) -> dict[str, Any]:
        """llama-server appends `timings` to the last chunk of a stream: the include_usage chunk
        when there is one, else the finish chunk (tools/server `deltas.back()`)."""
        return {"timings": self.timings(seq)}

    def not_found(self) -> web.Response:
        """llama-server's 404."""
        return llama_error(404, "File Not Found", "not_found_error")

    def model_card_extras(self) -> dict[str, Any]:
        """llama-server's model card `meta`."""
        return {"meta": {"n_ctx_train": N_CTX, "vocab_type": 2}}

    def stats(self) -> dict[str, object]:
        """Slot lengths and RAM-cache entries for `/sim/stats`."""
        return {
            "slot_tokens": [len(s.tokens) for s in self.slots],
            "ram_cache_entries": len(self.ram),
            **self.idle.stats(),
        }

    # -- routes ----------------------------------------------------------------------------
    def add_routes(self, app: web.Application) -> None:
        """/health, /props, /slots, /slots/{id}?action=, native /completion, /tokenize."""
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/props", self.handle_props)
        app.router.add_get("/slots", self.handle_slots)
        app.router.add_post("/slots/{id_slot}", self.handle_slot_action)
        app.router.add_post("/completion", self.handle_completion)
        app.router.add_post("/completions", self.handle_completion)
        app.router.add_post("/tokenize", self.handle_tokenize)

    async def handle_slots(self, request: web.Request) -> web.Response:
        """GET /slots: a task (it wakes a sleeping server); a router wants `?model=`."""
        refused = without_model(request, self.config.served_model) if self.config.router_mode else None
        if refused is not None:
            return refused
        self._task()
        return await super().handle_slots(request)

    async def handle_health(self, request: web.Request) -> web.Response:
        """GET /health."""
        return json_body({"status": "ok"})

    async def handle_props(self, request: web.Request) -> web.Response:
        """GET /props: detection reads `build_info` and `total_slots`; it wakes no sleeping server."""
        if self.config.router_mode:
            if "model" not in request.query:
                return json_body(router_props(self.config.engine_version))
            refused = without_model(request, self.config.served_model)
            if refused is not None:
                return refused
        return json_body(
            {
                "is_sleeping": self.idle.asleep(busy=bool(self.engine.running)),
                "default_generation_settings": {
                    "n_ctx": N_CTX,
                    "params": {"n_predict": -1, "cache_prompt": True},
                },
                "total_slots": len(self.slots),
                "model_path": self.config.served_model,
                "chat_template": "chatml",
                "build_info": self.config.engine_version,
                "endpoint_slots": True,
                "endpoint_props": False,
                "endpoint_metrics": True,
            }
        )

    async def handle_tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize: `content` → `tokens` (ids, or {id, piece} with `with_pieces`), as llama-server.

        Only the content's tokens: llama-server applies no chat template here.
        """
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        content = body.get("content")
        # Without `content` llama-server answers an empty list (seen on 7e4c0a9), not an error.
        tokens = self.template.tokenize(content) if isinstance(content, str) else []
        ids = token_ids(tokens)
        if body.get("with_pieces") is True:
            return json_body({"tokens": [{"id": i, "piece": t} for i, t in zip(ids, tokens, strict=True)]})
        return json_body({"tokens": ids})

    async def handle_completion(self, request: web.Request) -> web.StreamResponse:
        """POST /completion: native route; `tokens_cached` is the slot's length, not a hit count."""
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        try:
            prompt = self.template.completion(body.get("prompt"))
        except PromptError as exc:
            return llama_error(400, str(exc))
        n_predict = body.get("n_predict", body.get("max_tokens", -1))
        if isinstance(n_predict, bool) or not isinstance(n_predict, int):
            return llama_error(400, "n_predict must be an integer")
        # -1 is "until EOS or context end" upstream; the sim has no EOS, so use the default.
        seq = Sequence(
            prompt=prompt, max_tokens=self.config.default_max_tokens if n_predict < 0 else n_predict
        )
        bad = self.parse_options(body, seq)
        if bad is not None:
            return bad

        def final() -> dict[str, Any]:
            """The last (or only) native answer object."""
            return {
                "index": 0,
                "content": "" if body.get("stream") is True else seq.text,
                "tokens": [],
                "id_slot": seq.slot,
                "stop": True,
                "model": self.config.served_model,
                "tokens_predicted": seq.completion_tokens,
                "tokens_evaluated": seq.prompt_tokens,
                "stop_type": "limit",
                "stopping_word": "",
                "tokens_cached": len(self.slots[seq.slot].tokens),
                "timings": self.timings(seq),
            }

        async with self.engine.session(seq):
            await self.engine.prefill(seq)
            if body.get("stream") is not True:
                await self.engine.generate(seq)
                return json_body(final())
            resp = await sse_response(request)
            async with aclosing(self.engine.decode(seq)) as tokens:
                async for token in tokens:
                    await send_event(
                        resp,
                        {
                            "index": 0,
                            "content": token,
                            "tokens": [],
                            "stop": False,
                            "id_slot": seq.slot,
                            "tokens_predicted": seq.completion_tokens,
                            "tokens_evaluated": seq.prompt_tokens,
                        },
                    )
            # The native stream ends with the stop event; no `[DONE]` (that is the OAI routes').
            await send_event(resp, final())
            await resp.write_eof()
            return resp

    def metrics_answer(self, request: web.Request) -> web.Response | None:
        """/metrics is a task (it wakes a sleeping server); a router wants `?model=`."""
        if self.config.router_mode:
            refused = without_model(request, self.config.served_model)
            if refused is not None:
                return refused
        self._task()
        return None

    def metric_families(self) -> list[Metric]:
        """llamacpp: families of `--metrics`."""
        engine = self.engine
        prompt = CounterMetricFamily("llamacpp:prompt_tokens", "Number of prompt tokens processed.")
        prompt.add_metric([], engine.prompt_tokens_total)
        cached = CounterMetricFamily(
            "llamacpp:prompt_tokens_cached", "Number of prompt tokens reused from cache."
        )
        cached.add_metric([], engine.cached_tokens_total)
        predicted = CounterMetricFamily("llamacpp:tokens_predicted", "Number of generation tokens processed.")
        predicted.add_metric([], engine.generation_tokens_total)
        processing = GaugeMetricFamily("llamacpp:requests_processing", "Number of requests processing.")
        processing.add_metric([], len(engine.running))
        deferred = GaugeMetricFamily("llamacpp:requests_deferred", "Number of requests deferred.")
        deferred.add_metric([], engine.waiting)
        return [prompt, cached, predicted, processing, deferred]
