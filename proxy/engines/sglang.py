"""SGLang: `POST /flush_cache?timeout=<s>`; trust the status, not the text (ENGINES.md, SGLang)."""

from __future__ import annotations

import aiohttp

from proxy.engines.answer import AnswerRules, read_answer
from proxy.engines.base import Attempt, AttemptPlan, Dialect, EngineKind, engine_call

__all__ = ["SglangDialect"]

AUTH_HINT = (
    "SGLang wants its admin key (--admin-api-key, else --api-key) on /flush_cache: give the "
    "sidecar the same key with engine_api_key (CACHEWITNESS_ENGINE_API_KEY)"
)
# 0.4.6–0.5.9 say "Cache flushed" even on a 400: the status decides, the body is evidence.
RULES = AnswerRules(
    route="/flush_cache",
    hint="this SGLang has no /flush_cache; check --engine and the upstream URL",
    busy={400: "engine busy"},
    rejected={
        status: (f"HTTP {status}: the engine refused the sidecar's key", AUTH_HINT) for status in (401, 403)
    },
)


class SglangDialect(Dialect):
    """Flushes SGLang's radix cache; a 400 is a refusal (busy, or another flush running)."""

    kind = EngineKind.SGLANG

    def __init__(self, api_key: str | None = None) -> None:
        """`api_key`: the engine's admin key (sent as a bearer token), if it has one."""
        self._api_key = api_key

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """POST /flush_cache?timeout=<what is left of the retry window>."""
        wait_s = max(0.0, plan.retry_seconds)
        url = f"{plan.base_url}/flush_cache?timeout={wait_s:g}"
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else None
        # 0.5.10+ waits up to `timeout` for idle before answering, so the call may take that long.
        reply = await engine_call(session, "POST", url, timeout_s=plan.timeout_s + wait_s, headers=headers)
        return read_answer(reply, RULES)
