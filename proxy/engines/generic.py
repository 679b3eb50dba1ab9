"""Any other OpenAI-compatible engine: a reset route only when one is configured."""

from __future__ import annotations

import aiohttp

from proxy.engines.base import Attempt, AttemptPlan, Dialect, unsupported
from proxy.engines.call import bearer, engine_call
from proxy.engines.response import ResponseRules, read_response
from proxy.vocabulary import EngineKind

__all__ = ["NO_PATH_HINT", "GenericDialect"]

NO_PATH_HINT = (
    "this engine has no known prefix-cache reset; if it has one, tell the sidecar with reset_path "
    "(--reset-path / CACHEWITNESS_RESET_PATH), and reset_method, busy_statuses, success_field as needed"
)


class GenericDialect(Dialect):
    """A configured reset call: `reset_method reset_path`; `busy_statuses` refuse; `success_field` confirms."""

    kind = EngineKind.GENERIC

    def __init__(
        self,
        *,
        reset_method: str = "POST",
        reset_path: str | None = None,
        busy_statuses: tuple[int, ...] = (409, 429, 503),
        success_field: str | None = None,
        health_path: str = "/health",
        api_key: str | None = None,
    ) -> None:
        """The configured reset call and how to read its answer."""
        self._method = reset_method.upper()
        self._path = reset_path
        self._rules = ResponseRules(
            route=f"{self._method} {reset_path}",
            hint=f"the engine does not serve {self._method} {reset_path}: check reset_path and reset_method",
            busy=dict.fromkeys(busy_statuses, "busy"),
            unsupported=frozenset({404, 405, 501}),
            success_field=success_field or "success",
        )
        self.health_path = health_path
        self._headers = bearer(api_key)

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """Make the configured call; with none configured the reset is unsupported."""
        if not self._path:
            return unsupported(plan.base_url, "no reset route is known for this engine", NO_PATH_HINT)
        url = f"{plan.base_url}{self._path}"
        return read_response(
            await engine_call(session, self._method, url, timeout_s=plan.timeout_s, headers=self._headers),
            self._rules,
        )
