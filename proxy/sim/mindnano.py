"""mindnano dialect: one request at a time (429), /v1/cache/clear, /v1/cancel, per-user cache."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from proxy.sim.dialect import Dialect
from proxy.sim.engine import AdmissionRefused, Sequence
from proxy.sim.wire import error_response, json_body

__all__ = ["MindnanoDialect"]


def _busy() -> web.Response:
    """The 429 mindnano answers while a request is active."""
    return error_response(429, "engine busy: one request at a time", "busy")


class MindnanoDialect(Dialect):
    """mindnano: a single-sequence engine whose prefix cache is isolated per `user`."""

    name = "mindnano"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """No active request at start."""
        super().__init__(*args, **kwargs)
        self.active: Sequence | None = None

    async def admit(self, seq: Sequence) -> None:
        """One at a time: a second request while one is active is refused with 429, never queued."""
        if self.active is not None:
            raise AdmissionRefused(_busy())
        self.active = seq

    def release(self, seq: Sequence, completed: bool) -> None:
        """Free the engine and keep the computed prompt (and output with reuse_generated_state)."""
        if self.active is seq:
            self.active = None
        super().release(seq, completed)

    def parse_options(self, body: dict[str, Any], seq: Sequence) -> web.Response | None:
        """`user` (cache namespace), `cache_prompt`, `reuse_generated_state`."""
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            return error_response(400, "'user' must be a string")
        seq.namespace = user or ""
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
        """POST /v1/cache/clear: 429 while a request is active, else clears every user's cache."""
        if self.active is not None:
            return _busy()
        self.clear_cache()
        return json_body({"cleared": True})

    async def handle_cancel(self, request: web.Request) -> web.Response:
        """POST /v1/cancel: the active request stops at its next token (409 or a cancelled stream end)."""
        if self.active is None:
            return json_body({"cancel_requested": False})
        self.active.cancel_requested = True
        return json_body({"cancel_requested": True})
