"""SGLang: `POST /flush_cache?timeout=<s>`; trust the status, not the text (ENGINES.md, SGLang)."""

from __future__ import annotations

import aiohttp

from proxy.engines.base import (
    ACKNOWLEDGED,
    ERROR,
    REFUSED,
    Attempt,
    Dialect,
    engine_call,
    failed_attempt,
    outcome_for_status,
    unsupported,
)

__all__ = ["SglangDialect"]

AUTH_HINT = (
    "SGLang wants its admin key (--admin-api-key, else --api-key) on /flush_cache: give the "
    "sidecar the same key with engine_api_key (CACHEWITNESS_ENGINE_API_KEY)"
)


class SglangDialect(Dialect):
    """Flushes SGLang's radix cache; a 400 is a refusal (busy, or another flush running)."""

    kind = "sglang"

    def __init__(self, api_key: str | None = None) -> None:
        """`api_key`: the engine's admin key (sent as a bearer token), if it has one."""
        self._api_key = api_key

    async def reset_once(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        force: bool,
        retry_seconds: float,
        timeout_s: float,
    ) -> Attempt:
        """POST /flush_cache?timeout=<what is left of the retry window>."""
        wait_s = max(0.0, retry_seconds)
        url = f"{base_url}/flush_cache?timeout={wait_s:g}"
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else None
        # 0.5.10+ waits up to `timeout` for idle before answering, so the call may take that long.
        reply = await engine_call(session, "POST", url, timeout_s=timeout_s + wait_s, headers=headers)
        calls = (reply.call,)
        status = reply.status
        if status is None:
            return failed_attempt(reply, reply.call.url)
        if status == 200:
            return Attempt(ACKNOWLEDGED, status=status, success=True, url=reply.call.url, calls=calls)
        if status == 400:
            # 0.4.6–0.5.9 say "Cache flushed" even on a 400: the status decides, the body is evidence.
            return Attempt(
                REFUSED,
                status=status,
                success=False,
                error="HTTP 400 (engine busy)",
                url=reply.call.url,
                calls=calls,
            )
        if status in (401, 403):
            return Attempt(
                ERROR,
                status=status,
                error=f"HTTP {status}: the engine refused the sidecar's key",
                url=reply.call.url,
                calls=calls,
                hint=AUTH_HINT,
            )
        if status == 404:
            return unsupported(
                reply.call.url,
                "HTTP 404: /flush_cache is not served",
                "this SGLang has no /flush_cache; check --engine and the upstream URL",
                calls,
            )
        outcome, error = outcome_for_status(status)
        return Attempt(outcome, status=status, error=error, url=reply.call.url, calls=calls)
