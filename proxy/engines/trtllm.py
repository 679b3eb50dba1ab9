"""TensorRT-LLM's `trtllm-serve`: `POST /reset_prefix_cache` where the serving version has it (docs/engines.md).

The route was merged (NVIDIA/TensorRT-LLM #14970), reverted, and proposed again (#15313); the
`openai_server.py` read for docs/engines.md has none. So the route is probed on every reset: a
404 is `unsupported` with a hint, a 2xx is read like vLLM's (`{"success": bool}`; a 2xx without
the field is accepted, unconfirmed). Its `/metrics` is JSON iteration stats; the Prometheus text
is at `/prometheus/metrics`, served only with `return_perf_metrics: true`.
"""

from __future__ import annotations

import aiohttp

from proxy.engines.base import Attempt, AttemptPlan, Dialect
from proxy.engines.call import bearer, engine_call
from proxy.engines.response import ResponseRules, read_response
from proxy.engines.routes import NativeReset, control
from proxy.vocabulary import EngineKind

__all__ = ["CONTROL_ROUTES", "METRICS_PATH", "NATIVE_RESET", "TrtllmDialect"]

METRICS_PATH = "/prometheus/metrics"
NO_ROUTE_HINT = (
    "this trtllm-serve has no /reset_prefix_cache (merged in TensorRT-LLM #14970, reverted, "
    "proposed again in #15313): run a TensorRT-LLM that serves it, or restart the engine between cases"
)
UNCONFIRMED_WARNING = (
    "trtllm-serve answered 2xx without a `success` field: the reset was accepted but the "
    "engine did not say it cleared the cache"
)
RULES = ResponseRules(
    route="/reset_prefix_cache",
    hint=NO_ROUTE_HINT,
    success_field="success",
    unconfirmed_warning=UNCONFIRMED_WARNING,
    # FastAPI answers 405 when a route of that path exists for other methods only.
    unsupported=frozenset({404, 405}),
)

# trtllm-serve's routes besides inference (tensorrt_llm/serve/openai_server.py, register_routes):
# the RL-only memory and weight routes, the KV cache event queue (a POST drains it), the disagg
# clock offset, the KV cache hints that truncate cached blocks.
CONTROL_ROUTES = (
    control("/reset_prefix_cache"),
    control("/release_memory"),
    control("/resume_memory"),
    control("/update_weights"),
    control("/kv_cache_events"),
    control("/steady_clock_offset", "POST"),
    control("/v1/kv_cache_hints"),
)
# Same shape as vLLM's route, which #14970 followed.
NATIVE_RESET = NativeReset(
    rule=control("/reset_prefix_cache", "POST"),
    content_type="application/json",
    refusal_status=200,
    refusal_body=b'{"success":false}',
)


class TrtllmDialect(Dialect):
    """Resets trtllm-serve's KV cache reuse state where the route exists; `success: false` is a refusal."""

    kind = EngineKind.TRTLLM
    control_routes = CONTROL_ROUTES
    native_reset = NATIVE_RESET

    def __init__(self, api_key: str | None = None) -> None:
        """`api_key`: the engine's own key, sent as a bearer token, if it has one."""
        self._headers = bearer(api_key)

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """POST /reset_prefix_cache and read the `success` field."""
        url = f"{plan.base_url}/reset_prefix_cache"
        reply = await engine_call(session, "POST", url, timeout_s=plan.timeout_s, headers=self._headers)
        return read_response(reply, RULES)
