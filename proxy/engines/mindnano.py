"""mindnano: `POST /v1/cache/clear`; one request at a time, 429 while busy (ENGINES.md, mindnano)."""

from __future__ import annotations

import aiohttp

from proxy.engines.base import (
    ACKNOWLEDGED,
    REFUSED,
    Attempt,
    Dialect,
    engine_call,
    failed_attempt,
    outcome_for_status,
    unsupported,
)

__all__ = ["MindnanoDialect"]


class MindnanoDialect(Dialect):
    """Clears mindnano's prefix cache; a 429 means a request is running."""

    kind = "mindnano"

    async def reset_once(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        force: bool,
        retry_seconds: float,
        timeout_s: float,
    ) -> Attempt:
        """POST /v1/cache/clear."""
        reply = await engine_call(session, "POST", f"{base_url}/v1/cache/clear", timeout_s=timeout_s)
        calls = (reply.call,)
        status = reply.status
        if status is None:
            return failed_attempt(reply, reply.call.url)
        if 200 <= status < 300:
            return Attempt(ACKNOWLEDGED, status=status, success=True, url=reply.call.url, calls=calls)
        if status == 429:
            return Attempt(
                REFUSED,
                status=status,
                success=False,
                error="HTTP 429 (a request is running)",
                url=reply.call.url,
                calls=calls,
            )
        if status == 404:
            return unsupported(
                reply.call.url,
                "HTTP 404: /v1/cache/clear is not served",
                "this engine has no /v1/cache/clear; check --engine and the upstream URL",
                calls,
            )
        outcome, error = outcome_for_status(status)
        return Attempt(outcome, status=status, error=error, url=reply.call.url, calls=calls)
