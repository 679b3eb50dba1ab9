"""mindnano: `POST /v1/cache/clear`; one request at a time, 429 while busy (ENGINES.md, mindnano)."""

from __future__ import annotations

import aiohttp

from proxy.engines.answer import AnswerRules, read_answer
from proxy.engines.base import Attempt, AttemptPlan, Dialect, EngineKind, engine_call

__all__ = ["MindnanoDialect"]

RULES = AnswerRules(
    route="/v1/cache/clear",
    hint="this engine has no /v1/cache/clear; check --engine and the upstream URL",
    busy={429: "a request is running"},
)


class MindnanoDialect(Dialect):
    """Clears mindnano's prefix cache; a 429 means a request is running."""

    kind = EngineKind.MINDNANO

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """POST /v1/cache/clear."""
        reply = await engine_call(
            session, "POST", f"{plan.base_url}/v1/cache/clear", timeout_s=plan.timeout_s
        )
        return read_answer(reply, RULES)
