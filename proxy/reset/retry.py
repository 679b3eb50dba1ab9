"""The retry loop of one engine reset: a dialect's attempts, a refusal retried while the window allows."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import aiohttp

from proxy.engines.base import Attempt, AttemptPlan, CacheReset, Dialect
from proxy.engines.call import EngineCall
from proxy.vocabulary import ResetAnswer

__all__ = ["INTERRUPTED_BY_SHUTDOWN", "RESET_RETRY_INTERVAL_SECONDS", "interrupted", "retry_reset"]

log = logging.getLogger("cachewitness.reset")

# vLLM refuses while blocks are held and says callers may retry: every half second, as the reference client.
RESET_RETRY_INTERVAL_SECONDS = 0.5
# The error of a reset that shutdown cut short past the grace period.
INTERRUPTED_BY_SHUTDOWN = "interrupted by shutdown"


async def _attempt(dialect: Dialect, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
    """One attempt; a dialect that raises (a bug) becomes an `error` outcome instead of a crash."""
    try:
        return await dialect.reset_once(session, plan)
    except Exception as exc:
        log.exception("reset dialect failed", extra={"event": "reset_dialect_failed", "kind": dialect.kind})
        return Attempt(
            ResetAnswer.ERROR,
            error=f"internal error in the {dialect.kind} dialect: {type(exc).__name__}",
            url=plan.base_url,
        )


async def retry_reset(
    dialect: Dialect,
    session: aiohttp.ClientSession,
    base_url: str,
    *,
    force: bool,
    retry_seconds: float,
    timeout_s: float,
    retry: bool = True,
) -> CacheReset:
    """Reset, retrying a refusal every 0.5 s while the window allows; no attempt starts after it (the reference's loop).

    Each attempt is told what is left of the window (`AttemptPlan.retry_seconds`): an engine
    that blocks instead of refusing (llama.cpp) bounds its wait by it.
    With `retry` false there is one attempt; `retry_seconds` is then only what the dialect
    passes on (SGLang's `?timeout=`).
    """
    at_ns = time.time_ns()
    deadline = time.monotonic() + retry_seconds
    attempts = 1
    plan = AttemptPlan(base_url, force=force, retry_seconds=retry_seconds, timeout_s=timeout_s)
    attempt = await _attempt(dialect, session, plan)
    calls: list[EngineCall] = list(attempt.calls)
    while (
        retry
        and attempt.outcome == ResetAnswer.REFUSED
        and deadline - time.monotonic() >= RESET_RETRY_INTERVAL_SECONDS
    ):
        await asyncio.sleep(RESET_RETRY_INTERVAL_SECONDS)
        attempts += 1
        plan = replace(plan, retry_seconds=max(0.0, deadline - time.monotonic()))
        attempt = await _attempt(dialect, session, plan)
        calls.extend(attempt.calls)
    return CacheReset.from_attempts(
        attempt, at_ns=at_ns, attempts=attempts, calls=tuple(calls), answered_at_ns=time.time_ns()
    )


def interrupted(url: str, at_ns: int) -> CacheReset:
    """The outcome of a round that shutdown cut short: whether the engine reset is not known."""
    cut_short = Attempt(ResetAnswer.ERROR, error=INTERRUPTED_BY_SHUTDOWN, url=url)
    return CacheReset.from_attempts(
        cut_short, at_ns=at_ns, attempts=0, calls=(), answered_at_ns=time.time_ns()
    )
