"""Any other OpenAI-compatible engine: a reset route only when one is configured."""

from __future__ import annotations

import aiohttp

from proxy.engines.base import (
    ACCEPTED_UNVERIFIED,
    ACKNOWLEDGED,
    REFUSED,
    Attempt,
    Dialect,
    engine_call,
    failed_attempt,
    outcome_for_status,
    success_field,
    unsupported,
)

__all__ = ["NO_PATH_HINT", "GenericDialect"]

NO_PATH_HINT = (
    "this engine has no known prefix-cache reset; if it has one, tell the sidecar with reset_path "
    "(--reset-path / CACHEWITNESS_RESET_PATH), and reset_method, busy_statuses, success_field as needed"
)


class GenericDialect(Dialect):
    """A configured reset call: `reset_method reset_path`; `busy_statuses` refuse; `success_field` confirms."""

    kind = "generic"

    def __init__(
        self,
        *,
        reset_method: str = "POST",
        reset_path: str | None = None,
        busy_statuses: tuple[int, ...] = (409, 429, 503),
        success_field: str | None = None,
        health_path: str = "/health",
    ) -> None:
        """The configured reset call and how to read its answer."""
        self._method = reset_method.upper()
        self._path = reset_path
        self._busy = frozenset(busy_statuses)
        self._field = success_field
        self.health_path = health_path

    async def reset_once(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        force: bool,
        retry_seconds: float,
        timeout_s: float,
    ) -> Attempt:
        """Make the configured call; with none configured the reset is unsupported."""
        if not self._path:
            return unsupported(base_url, "no reset route is known for this engine", NO_PATH_HINT)
        reply = await engine_call(session, self._method, f"{base_url}{self._path}", timeout_s=timeout_s)
        calls = (reply.call,)
        status = reply.status
        url = reply.call.url
        if status is None:
            return failed_attempt(reply, url)
        if status in self._busy:
            return Attempt(
                REFUSED, status=status, success=False, error=f"HTTP {status} (busy)", url=url, calls=calls
            )
        if status in (404, 405, 501):
            hint = f"the engine does not serve {self._method} {self._path}: check reset_path and reset_method"
            return unsupported(url, f"HTTP {status}", hint, calls)
        if not 200 <= status < 300:
            outcome, error = outcome_for_status(status)
            return Attempt(outcome, status=status, error=error, url=url, calls=calls)
        # As the reference client does: only `true` is a yes, another value a refusal, no field unconfirmed.
        success = success_field(reply.json(), self._field or "success")
        if success is True:
            return Attempt(ACKNOWLEDGED, status=status, success=True, url=url, calls=calls)
        if success is False:
            return Attempt(
                REFUSED,
                status=status,
                success=False,
                error=f"{self._field or 'success'} not true",
                url=url,
                calls=calls,
            )
        return Attempt(ACCEPTED_UNVERIFIED, status=status, url=url, calls=calls)
