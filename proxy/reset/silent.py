"""A reset whose 200 says nothing, found warm by the canary: a refusal to retry, each try with a fresh canary.

vLLM's Rust front end answers a bare 200 whether or not the engine reset (proxy/engines/modes.py).
When the canary then finds its prompt still cached, the engine most likely refused (blocks were
still held), as the Python server would have said with `{"success": false}`. So, within the
reset's `retry_seconds`, the whole canary round runs again with fresh prompts (the old ones
are known warm); when the window is spent and the cache is still warm, the reset is `refused`.

With the events witness alone (`verify: events`) there is no such proof of warmth, only a clear
that did not come: the reset is sent again (each time under a fresh events check) while the
window allows, and a reset whose clear never came stays `accepted_unverified`, unverified.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

from proxy.engines.base import CacheReset
from proxy.reset.retry import RESET_RETRY_INTERVAL_SECONDS
from proxy.vocabulary import ResetAnswer, Verified
from proxy.witnesses.canary import Canary, ResetCall, verify_reset
from proxy.witnesses.kv_events.witness import EventsCheck
from proxy.witnesses.verification import Verification

__all__ = ["events_until_cleared", "verify_until_cold"]


def _silently_refused(reset: CacheReset, verification: Verification) -> bool:
    """A 200 that said nothing, after which the canary found the cache warm."""
    return reset.outcome == ResetAnswer.ACCEPTED_UNVERIFIED and verification.verified == Verified.CONTRADICTED


async def verify_until_cold(
    first: Canary, fresh: Callable[[], Canary], reset: ResetCall, *, window_s: float
) -> tuple[CacheReset, Verification]:
    """Canary rounds until one is not contradicted or the window is spent; every call listed."""
    deadline = time.monotonic() + window_s
    done, verification = await verify_reset(first, reset)
    rounds, attempts, calls, at_ns = 1, done.attempts, list(done.calls), done.at_ns
    while (
        _silently_refused(done, verification) and deadline - time.monotonic() >= RESET_RETRY_INTERVAL_SECONDS
    ):
        await asyncio.sleep(RESET_RETRY_INTERVAL_SECONDS)
        done, verification = await verify_reset(fresh(), reset)
        rounds += 1
        attempts += done.attempts
        calls.extend(done.calls)
    if _silently_refused(done, verification):
        error = (
            f"refused: the engine answered 200 without saying whether it reset, and a fresh canary "
            f"was still cached after it on {rounds} rounds"
        )
        done = replace(done, outcome=ResetAnswer.REFUSED, success=False, error=error)
    elif rounds > 1:
        reason = f"{verification.reason} (round {rounds}: the earlier rounds' canaries were still cached)"
        verification = replace(verification, reason=reason)
    return replace(done, at_ns=at_ns, attempts=attempts, calls=tuple(calls)), verification


def _uncleared(reset: CacheReset, check: EventsCheck) -> bool:
    """A 200 that said nothing, after which the engine published no clear."""
    report = check.report
    return (
        reset.outcome == ResetAnswer.ACCEPTED_UNVERIFIED
        and report is not None
        and report.result != Verified.VERIFIED
    )


async def events_until_cleared(
    first: EventsCheck, fresh: Callable[[], EventsCheck | None], reset: ResetCall, *, window_s: float
) -> tuple[CacheReset, EventsCheck]:
    """The reset under the events witness, sent again while no clear follows its 200; the last check."""
    deadline = time.monotonic() + window_s
    check = first
    done = await check.wrap(reset)()
    attempts, calls, at_ns = done.attempts, list(done.calls), done.at_ns
    while _uncleared(done, check) and deadline - time.monotonic() >= RESET_RETRY_INTERVAL_SECONDS:
        following = fresh()
        if following is None:
            break
        calls.extend(check.calls)  # the earlier check's flush probes, in order
        await asyncio.sleep(RESET_RETRY_INTERVAL_SECONDS)
        check = following
        done = await check.wrap(reset)()
        attempts += done.attempts
        calls.extend(done.calls)
    return replace(done, at_ns=at_ns, attempts=attempts, calls=tuple(calls)), check
