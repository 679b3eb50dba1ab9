"""mindnano dialect: one request at a time (429), one cache entry tagged with its `user`, clear, cancel.

mindnano's semantics (issue 18), in the simulator's terms:
- one token per code point; a 16-token preamble, `start role content... end` per message and
  `start assistant` as the generation prompt (one user message of n code points: n + 21 tokens);
- the cache is the prompt of the last completed request with `cache_prompt` (default true),
  tagged with its `user`, without the generated tokens unless `reuse_generated_state`;
- reuse only for the same `user`: the whole prompt on an exact repeat, else a 256-token
  checkpoint (checkpoint_cache.py);
- `/v1/cancel` ends the active request with 409 and discards the cache.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from proxy.sim.checkpoint_cache import CheckpointCache
from proxy.sim.dialect import SimDialect
from proxy.sim.engine import AdmissionRefused, Sequence
from proxy.sim.text import ChatTemplate
from proxy.sim.wire import error_response, json_body

__all__ = ["TEMPLATE", "MindnanoDialect"]

# One token per Unicode code point ("1" and "请" are one token each) and a 16-token preamble.
TEMPLATE = ChatTemplate(
    tokenize=list,
    preamble=tuple(f"<|preamble_{i}|>" for i in range(16)),
    start="<|start|>",
    end="<|end|>",
)


def _busy() -> web.Response:
    """The 429 mindnano answers while a request is active."""
    return error_response(429, "engine busy: one request at a time", "busy")


class MindnanoDialect(SimDialect):
    """mindnano: a single-sequence engine with one prompt-cache entry for everyone."""

    name = "mindnano"
    template = TEMPLATE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """No active request and an empty cache at start."""
        super().__init__(*args, **kwargs)
        self.active: Sequence | None = None
        self.prompt_cache = CheckpointCache()

    async def admit(self, seq: Sequence) -> None:
        """One at a time: a second request while one is active is refused with 429, never queued."""
        if self.active is not None:
            raise AdmissionRefused(_busy())
        self.active = seq

    def release(self, seq: Sequence, completed: bool) -> None:
        """Free the engine; a completed cached request's prompt becomes the one entry."""
        if self.active is seq:
            self.active = None
        # A cancelled request never writes: the cancel discarded the cache for good.
        if completed and seq.cache_prompt and not seq.cancel_requested:
            self.prompt_cache.store(self._state_tokens(seq), seq.user)

    def _state_tokens(self, seq: Sequence) -> list[str]:
        """What the saved state covers: the prompt, plus the reply's code points if kept."""
        if seq.reuse_generated_state:
            return seq.prompt + self.template.tokenize(seq.text)
        return seq.prompt

    def lookup(self, seq: Sequence) -> int:
        """Cached tokens: none without cache_prompt, else the entry's exact or checkpoint reuse."""
        if not seq.cache_prompt:
            return 0
        return self.prompt_cache.lookup(seq.prompt, seq.user)

    def prefilled(self, seq: Sequence) -> None:
        """Nothing is cached until the request completes."""

    def parse_options(self, body: dict[str, Any], seq: Sequence) -> web.Response | None:
        """`user` (the cache entry's tag), `cache_prompt`, `reuse_generated_state` (default false)."""
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            return error_response(400, "'user' must be a string")
        seq.user = user
        seq.reuse_generated_state = False
        for name in ("cache_prompt", "reuse_generated_state"):
            value = body.get(name)
            if value is None:
                continue
            if not isinstance(value, bool):
                return error_response(400, f"'{name}' must be a boolean")
            setattr(seq, name, value)
        return None

    def _metrics(self, seq: Sequence) -> dict[str, Any]:
        """mindnano's own cache report."""
        return {
            "mindnano_metrics": {
                "cached_tokens": seq.cached,
                "prompt_evaluated_tokens": seq.prompt_tokens - seq.cached,
            }
        }

    def response_extras(self, seq: Sequence) -> dict[str, Any]:
        """Non-stream responses carry top-level `mindnano_metrics`."""
        return self._metrics(seq)

    def finish_chunk_extras(self, seq: Sequence) -> dict[str, Any]:
        """In streams, `mindnano_metrics` rides on the last content event (the one with finish_reason)."""
        return self._metrics(seq)

    def usage_chunk_extras(self, seq: Sequence) -> dict[str, Any]:
        """...and on the include_usage chunk when there is one."""
        return self._metrics(seq)

    def add_routes(self, app: web.Application) -> None:
        """/health, /v1/cache/clear, /v1/cancel."""
        app.router.add_get("/health", self.handle_health)
        app.router.add_post("/v1/cache/clear", self.handle_clear)
        app.router.add_post("/v1/cancel", self.handle_cancel)

    async def handle_health(self, request: web.Request) -> web.Response:
        """GET /health: `active` says whether a request is running."""
        return json_body({"status": "ok", "active": self.active is not None})

    async def handle_clear(self, request: web.Request) -> web.Response:
        """POST /v1/cache/clear: 429 while a request is active, else empties the cache."""
        if self.active is not None:
            return _busy()
        self.clear_cache()
        return json_body({"cleared": True})

    async def handle_cancel(self, request: web.Request) -> web.Response:
        """POST /v1/cancel: the active request stops (409, or a cancelled stream end) and the cache goes."""
        if self.active is None:
            return json_body({"cancel_requested": False})
        self.active.cancel()
        self.prompt_cache.clear()
        return json_body({"cancel_requested": True})

    def clear_cache(self) -> int:
        """Drop the cache entry and count a reset."""
        self.engine.resets_total += 1
        return self.prompt_cache.clear()

    def stats(self) -> dict[str, object]:
        """Tokens held by the one cache entry (`/sim/stats`)."""
        return {"cache_entry_tokens": len(self.prompt_cache)}
