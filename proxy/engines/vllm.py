"""vLLM: `POST /reset_prefix_cache`, whose 200 answer must be read (ENGINES.md, vLLM)."""

from __future__ import annotations

from dataclasses import replace

import aiohttp

from proxy.engines.answer import AnswerRules, read_answer
from proxy.engines.base import Attempt, AttemptPlan, Dialect, EngineKind, engine_call

__all__ = ["VllmDialect"]

DEV_MODE_HINT = (
    "vLLM serves /reset_prefix_cache only in development mode: start it with "
    "VLLM_SERVER_DEV_MODE=1 in its environment"
)
LEGACY_WARNING = (
    "vLLM before 0.26 answers 200 with an empty body whatever happened: the reset "
    "was accepted but the engine did not say it cleared the cache"
)
# 0.26+ answers `{"success": false}` "while blocks are still held ... callers may retry".
RULES = AnswerRules(
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


class VllmDialect(Dialect):
    """Resets vLLM's prefix cache; `{"success": false}` is a refusal to retry."""

    kind = EngineKind.VLLM

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """POST /reset_prefix_cache?reset_external=true and read the `success` field."""
        # reset_external (0.13+) also clears connector/offload tiers (vllm #57727); older
        # versions ignore unknown params, so it is always sent. `device` is never sent.
        query = "reset_external=true" + ("&reset_running_requests=true" if plan.force else "")
        url = f"{plan.base_url}/reset_prefix_cache?{query}"
        reply = await engine_call(session, "POST", url, timeout_s=plan.timeout_s)
        return read_answer(reply, FORCED_RULES if plan.force else RULES)
