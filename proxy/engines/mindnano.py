"""mindnano: `POST /v1/cache/clear`; one request at a time, 429 while busy (ENGINES.md, mindnano)."""

from __future__ import annotations

import aiohttp

from proxy.engines.base import Attempt, AttemptPlan, Dialect
from proxy.engines.call import bearer, engine_call
from proxy.engines.response import ResponseRules, read_response
from proxy.engines.routes import NativeReset, control
from proxy.vocabulary import EngineKind

__all__ = ["CONTROL_ROUTES", "NATIVE_RESET", "MindnanoDialect"]

# /v1/cancel stops whichever request is running, whoever sent it, and drops the cache.
CONTROL_ROUTES = (control("/v1/cache/clear"), control("/v1/cancel"))
NATIVE_RESET = NativeReset(
    rule=control("/v1/cache/clear", "POST"),
    content_type="application/json",
    refusal_status=429,
    refusal_body=b'{"error":{"message":"the cache was not cleared","type":"busy","code":429}}',
)

RULES = ResponseRules(
    route="/v1/cache/clear",
    hint="this engine has no /v1/cache/clear; check --engine and the upstream URL",
    busy={429: "a request is running"},
)


class MindnanoDialect(Dialect):
    """Clears mindnano's prefix cache; a 429 means a request is running."""

    kind = EngineKind.MINDNANO
    control_routes = CONTROL_ROUTES
    native_reset = NATIVE_RESET

    def __init__(self, api_key: str | None = None) -> None:
        """`api_key`: the engine's own key, sent as a bearer token, if it has one."""
        self._headers = bearer(api_key)

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """POST /v1/cache/clear."""
        reply = await engine_call(
            session,
            "POST",
            f"{plan.base_url}/v1/cache/clear",
            timeout_s=plan.timeout_s,
            headers=self._headers,
        )
        return read_response(reply, RULES)
