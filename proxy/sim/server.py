"""The simulator's aiohttp app: OpenAI routes, SSE streaming, `/sim/stats`, `/metrics`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from proxy.sim.config import SimConfig
from proxy.sim.dialect import NullUsage, SimDialect
from proxy.sim.dynamo import DynamoDialect
from proxy.sim.engine import AdmissionRefused, Engine, Sequence, SequenceCancelled
from proxy.sim.kv_events import KvEventPublisher
from proxy.sim.llamacpp import LlamacppDialect
from proxy.sim.lmcache import serve_lmcache
from proxy.sim.mindnano import MindnanoDialect
from proxy.sim.openai import OpenaiDialect
from proxy.sim.sglang import SglangDialect
from proxy.sim.text import PromptError
from proxy.sim.trtllm import TrtllmDialect
from proxy.sim.vllm import VllmDialect
from proxy.sim.wire import (
    DONE,
    error_response,
    json_body,
    read_json,
    send_event,
    sse_response,
)

__all__ = ["SIM_ENGINE", "build_sim_app"]

SIM_ENGINE = web.AppKey("sim_engine", Engine)


_DIALECTS: dict[str, type[SimDialect]] = {
    "vllm": VllmDialect,
    "sglang": SglangDialect,
    "llamacpp": LlamacppDialect,
    "mindnano": MindnanoDialect,
    "trtllm": TrtllmDialect,
    "dynamo": DynamoDialect,
    "openai": OpenaiDialect,
}


def _max_tokens(body: dict[str, Any], default: int, *names: str) -> int | web.Response:
    """The request's generation limit from the first present field of `names`."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return error_response(400, f"'{name}' must be a non-negative integer")
        return value
    return default


class OpenAIRoutes:
    """`/v1/chat/completions`, `/v1/completions`, `/v1/models` on top of a dialect."""

    def __init__(self, engine: Engine, dialect: SimDialect) -> None:
        """Bind to one engine and its dialect."""
        self.engine = engine
        self.dialect = dialect
        self.config = engine.config

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._infer(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._infer(request, chat=False)

    async def _infer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """Parse, admit, prefill, decode and answer one OpenAI request."""
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        stream = body.get("stream") is True
        stream_options = body.get("stream_options")
        if stream_options is not None and self.config.reject_stream_options:
            return error_response(400, "Unrecognized request argument supplied: stream_options")
        if stream_options is not None and not stream and self.dialect.rejects_stream_options_without_stream:
            # vLLM names the field: `"param": "stream_options"` (protocol.py, VLLMValidationError).
            message = "Stream options can only be defined when `stream=True`."
            return error_response(400, message, param="stream_options")
        include_usage = (
            stream and isinstance(stream_options, dict) and stream_options.get("include_usage") is True
        )
        try:
            template = self.dialect.template
            prompt = template.chat(body.get("messages")) if chat else template.completion(body.get("prompt"))
        except PromptError as exc:
            return error_response(400, str(exc))
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        max_tokens = _max_tokens(body, self.config.default_max_tokens, *names)
        if isinstance(max_tokens, web.Response):
            return max_tokens
        seq = Sequence(prompt=prompt, max_tokens=max_tokens)
        bad = self.dialect.parse_options(body, seq) or self.dialect.route(request, body, seq)
        if bad is not None:
            return bad
        requested_model = body.get("model")
        model = requested_model if isinstance(requested_model, str) else self.config.served_model
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        async with self.engine.session(seq):
            try:
                await self.engine.prefill(seq)
                if stream:
                    return await self._stream(request, seq, chat, include_usage, ident, model)
                await self.engine.generate(seq)
            except SequenceCancelled:
                return self.dialect.cancelled_response(seq)
            return json_body(self._full_response(seq, chat, ident, model))

    def _full_response(self, seq: Sequence, chat: bool, ident: str, model: str) -> dict[str, Any]:
        """The non-stream answer body."""
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": seq.text},
                "logprobs": None,
                "finish_reason": "length",
            }
        else:
            choice = {"index": 0, "text": seq.text, "logprobs": None, "finish_reason": "length"}
        return {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": self.dialect.usage(seq),
            **self.dialect.response_extras(seq),
        }

    async def _stream(
        self, request: web.Request, seq: Sequence, chat: bool, include_usage: bool, ident: str, model: str
    ) -> web.StreamResponse:
        """Stream one token per SSE event, OpenAI framing, then `[DONE]`."""
        resp = await sse_response(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage_on_finish = include_usage and not chat and self.dialect.completions_usage_on_finish_chunk
        # OpenAI: once include_usage is on, every chunk but the usage chunk has "usage": null;
        # SGLang's pydantic era writes it whether asked or not.
        null_usage = self.dialect.null_usage == NullUsage.ALWAYS or (
            self.dialect.null_usage == NullUsage.WITH_INCLUDE_USAGE and include_usage and not usage_on_finish
        )

        def chunk(piece: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
            """One chunk with one choice."""
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
                if piece is not None:
                    delta["content"] = piece
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish,
                }
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            data: dict[str, Any] = {
                "id": ident,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
            }
            if null_usage:
                data["usage"] = None
            return data

        if chat:
            await send_event(resp, chunk(None, None, first=True))
        finish = "length"
        try:
            async with aclosing(self.engine.decode(seq)) as tokens:
                async for token in tokens:
                    await send_event(resp, chunk(token, None))
        except SequenceCancelled:
            # mindnano /v1/cancel: the stream ends with this finish reason (sim's choice).
            finish = "cancelled"
        final = chunk("" if not chat else None, finish)
        final.update(self.dialect.finish_chunk_extras(seq))
        if usage_on_finish:
            final["usage"] = self.dialect.usage(seq)
            final.update(self.dialect.usage_chunk_extras(seq))
        events = [final]
        if include_usage and not usage_on_finish:
            usage_chunk: dict[str, Any] = {
                "id": ident,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [],
                "usage": self.dialect.usage(seq),
            }
            usage_chunk.update(self.dialect.usage_chunk_extras(seq))
            events.append(usage_chunk)
        events[-1].update(self.dialect.last_event_extras(seq))
        for event in events:
            await send_event(resp, event)
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models with this dialect's `owned_by`."""
        card = {
            "id": self.config.served_model,
            "object": "model",
            "created": int(self.engine.started_at),
            "owned_by": self.dialect.name,
            **self.dialect.model_card_extras(),
        }
        return json_body({"object": "list", "data": [card]})


class _DialectCollector(Collector):
    """Reads the dialect's metric families at scrape time."""

    def __init__(self, dialect: SimDialect) -> None:
        """Collect from one dialect."""
        self.dialect = dialect

    def collect(self) -> Any:
        """Yield the current families."""
        yield from self.dialect.metric_families()


def _answers_middleware(dialect: SimDialect) -> Any:
    """Answer unknown routes with the dialect's own 404 body (FastAPI's `{"detail":"Not Found"}` for vLLM)."""

    @web.middleware
    async def not_found(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Replace aiohttp's text 404; send the answer of a refused admission."""
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return dialect.not_found()
        except AdmissionRefused as refused:
            return refused.response

    return not_found


def _add_kv_events(app: web.Application, dialect: SimDialect, publisher: KvEventPublisher) -> None:
    """Open the event sockets with the app, and the test hook that restarts the engine's seq."""

    async def sockets(app: web.Application) -> AsyncIterator[None]:
        """The PUB and ROUTER sockets live as long as the app."""
        await publisher.start()
        yield
        await publisher.close()

    async def restart(request: web.Request) -> web.Response:
        """POST /sim/kv_events/restart[?reconnect=1]: the cache emptied, seq at 0, nothing said (sim-only)."""
        await dialect.restart(reconnect=request.query.get("reconnect", "") in ("1", "true"))
        return json_body({"restarted": True, "seq": publisher.seq})

    app.cleanup_ctx.append(sockets)
    app.router.add_post("/sim/kv_events/restart", restart)


def build_sim_app(config: SimConfig) -> web.Application:
    """Build the simulator app for one dialect (serve it with handler_cancellation=True)."""
    dialect = _DIALECTS[config.dialect](config)
    engine = dialect.engine
    app = web.Application(middlewares=[_answers_middleware(dialect)])
    app[SIM_ENGINE] = engine
    routes = OpenAIRoutes(engine, dialect)
    app.router.add_post("/v1/chat/completions", routes.chat)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_get("/v1/models", routes.models)

    async def sim_stats(request: web.Request) -> web.Response:
        """GET /sim/stats: running/waiting and lifetime counters (sim-only)."""
        return json_body(engine.stats())

    app.router.add_get("/sim/stats", sim_stats)

    async def sim_restart(request: web.Request) -> web.Response:
        """POST /sim/restart: as if the engine restarted (counters at 0, every cache tier empty; sim-only)."""
        await dialect.restart()
        return json_body(engine.stats())

    app.router.add_post("/sim/restart", sim_restart)
    dialect.add_routes(app)
    if isinstance(dialect, VllmDialect) and dialect.lmcache is not None:
        tier = dialect.lmcache
        app.cleanup_ctx.append(lambda _app: serve_lmcache(tier))
    if dialect.kv_events is not None:
        _add_kv_events(app, dialect, dialect.kv_events)
    if dialect.metric_families():
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_DialectCollector(dialect))

        async def metrics(request: web.Request) -> web.Response:
            """GET /metrics in Prometheus text format 0.0.4."""
            engine.metrics_scrapes_total += 1
            other = dialect.metrics_answer(request)
            if other is not None:
                return other
            return web.Response(
                body=generate_latest(registry),
                headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
            )

        app.router.add_get("/metrics", metrics)
    return app
