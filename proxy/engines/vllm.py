"""vLLM: `POST /reset_prefix_cache`, whose 200 answer must be read (ENGINES.md, vLLM)."""

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

__all__ = ["VllmDialect"]

DEV_MODE_HINT = (
    "vLLM serves /reset_prefix_cache only in development mode: start it with "
    "VLLM_SERVER_DEV_MODE=1 in its environment"
)
LEGACY_WARNING = (
    "vLLM before 0.26 answers 200 with an empty body whatever happened: the reset "
    "was accepted but the engine did not say it cleared the cache"
)


class VllmDialect(Dialect):
    """Resets vLLM's prefix cache; `{"success": false}` is a refusal to retry."""

    kind = "vllm"

    async def reset_once(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        force: bool,
        retry_seconds: float,
        timeout_s: float,
    ) -> Attempt:
        """POST /reset_prefix_cache?reset_external=true and read the `success` field."""
        # reset_external (0.13+) also clears connector/offload tiers (vllm #57727); older
        # versions ignore unknown params, so it is always sent. `device` is never sent.
        query = "reset_external=true" + ("&reset_running_requests=true" if force else "")
        url = f"{base_url}/reset_prefix_cache?{query}"
        reply = await engine_call(session, "POST", url, timeout_s=timeout_s)
        calls = (reply.call,)
        status = reply.status
        if status is None:
            return failed_attempt(reply, reply.call.url)
        if status == 404:
            return unsupported(
                reply.call.url, "HTTP 404: /reset_prefix_cache is not served", DEV_MODE_HINT, calls
            )
        if not 200 <= status < 300:
            outcome, error = outcome_for_status(status)
            if force and status == 500:
                error += " (reset_running_requests=true: vLLM answers 500 when the forced reset still fails)"
            return Attempt(outcome, status=status, error=error, url=reply.call.url, calls=calls)
        success = success_field(reply.json())
        if success is True:
            return Attempt(ACKNOWLEDGED, status=status, success=True, url=reply.call.url, calls=calls)
        if success is False:
            # 0.26+: false "while blocks are still held ... callers may retry".
            return Attempt(
                REFUSED, status=status, success=False, error="success false", url=reply.call.url, calls=calls
            )
        return Attempt(
            ACCEPTED_UNVERIFIED, status=status, url=reply.call.url, calls=calls, warning=LEGACY_WARNING
        )
