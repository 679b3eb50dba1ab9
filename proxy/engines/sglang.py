"""SGLang: `POST /flush_cache?timeout=<s>`; trust the status, not the text (ENGINES.md, SGLang)."""

from __future__ import annotations

import aiohttp

from proxy.engines.base import Attempt, AttemptPlan, Dialect
from proxy.engines.call import bearer, engine_call
from proxy.engines.response import ResponseRules, read_response
from proxy.engines.routes import NativeReset, control, control_prefix
from proxy.vocabulary import EngineKind

__all__ = ["CONTROL_ROUTES", "NATIVE_RESET", "SglangDialect"]

AUTH_HINT = (
    "SGLang wants its admin key (--admin-api-key, else --api-key) on /flush_cache: give the "
    "sidecar the same key with upstream_api_key_file (or CACHEWITNESS_UPSTREAM_API_KEY)"
)
# 0.4.6–0.5.9 say "Cache flushed" even on a 400: the status decides, the body is evidence.
RULES = ResponseRules(
    route="/flush_cache",
    hint="this SGLang has no /flush_cache; check --engine and the upstream URL",
    busy={400: "engine busy"},
    rejected={
        status: (f"HTTP {status}: the engine refused the sidecar's key", AUTH_HINT) for status in (401, 403)
    },
)


# Every route SGLang 0.5.23 itself marks `@auth_level(AuthLevel.ADMIN_OPTIONAL)`
# (sglang/srt/entrypoints/http_server.py), plus older names of the same routes.
CONTROL_ROUTES = (
    control("/flush_cache"),
    control("/set_internal_state"),
    control_prefix("/dumper/"),
    control("/add_external_corpus"),
    control("/remove_external_corpus"),
    control("/list_external_corpora"),
    control_prefix("/hicache/"),
    control("/clear_hicache_storage_backend"),
    control("/start_profile"),
    control("/stop_profile"),
    control("/set_trace_level"),
    control("/freeze_gc"),
    control("/start_expert_distribution_record"),
    control("/stop_expert_distribution_record"),
    control("/dump_expert_distribution_record"),
    control_prefix("/update_weights_from_"),
    control("/init_weights_update_group"),
    control("/destroy_weights_update_group"),
    control("/init_weights_send_group_for_remote_instance"),
    control("/send_weights_to_remote_instance"),
    control("/get_remote_instance_transfer_engine_info"),
    control("/remote_instance_transfer_engine_info"),
    control("/begin_weight_update"),
    control("/end_weight_update"),
    control("/update_weight_version"),
    control("/get_weights_by_name"),
    control("/weights_checker"),
    control("/release_memory_occupation"),
    control("/resume_memory_occupation"),
    control("/slow_down"),
    control("/pd_role_switch"),
    control_prefix("/load_lora_adapter"),
    control("/unload_lora_adapter"),
    control("/configure_logging"),
    control("/abort_request"),
    control("/pause_generation"),
    control("/continue_generation"),
)
# SGLang's benchmark scripts flush here (sglang.benchmark.one_batch_server, 0.5.23).
NATIVE_RESET = NativeReset(
    rule=control("/flush_cache", "GET", "POST"),
    content_type="text/plain; charset=utf-8",
    refusal_status=400,
    refusal_body=b"Flush cache failed.\n",
    wait_param="timeout",
)


class SglangDialect(Dialect):
    """Flushes SGLang's radix cache; a 400 is a refusal (busy, or another flush running)."""

    kind = EngineKind.SGLANG
    control_routes = CONTROL_ROUTES
    native_reset = NATIVE_RESET

    def __init__(self, api_key: str | None = None) -> None:
        """`api_key`: the engine's admin key (sent as a bearer token), if it has one."""
        self._api_key = api_key

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """POST /flush_cache?timeout=<what is left of the retry window>."""
        wait_s = max(0.0, plan.retry_seconds)
        url = f"{plan.base_url}/flush_cache?timeout={wait_s:g}"
        headers = bearer(self._api_key)
        # 0.5.10+ waits up to `timeout` for idle before answering, so the call may take that long.
        reply = await engine_call(session, "POST", url, timeout_s=plan.timeout_s + wait_s, headers=headers)
        return read_response(reply, RULES)
