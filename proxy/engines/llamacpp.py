"""llama.cpp `llama-server`: erase every slot, `POST /slots/{i}?action=erase` (ENGINES.md, llama.cpp)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import aiohttp

from proxy.engines.base import (
    ACCEPTED_UNVERIFIED,
    ACKNOWLEDGED,
    ERROR,
    REFUSED,
    UNREACHABLE,
    Attempt,
    Dialect,
    Reply,
    engine_call,
    failed_attempt,
    outcome_for_status,
    unsupported,
)

__all__ = ["RAM_CACHE_WARNING", "LlamacppDialect"]

SLOT_SAVE_HINT = (
    "llama-server serves slot actions only with --slot-save-path DIR: restart it with "
    "--slot-save-path (and --cache-ram 0 for a full reset)"
)
# The host-RAM prompt cache keeps idle slots' prompts and no endpoint clears it: the same
# prompt after erasing every slot still showed cache_n=293 (ENGINES.md, llama.cpp).
RAM_CACHE_WARNING = (
    "llama.cpp slot erase is a full reset only with --cache-ram 0: its host-RAM prompt cache "
    "(--cache-ram, default 8192 MiB) survives erase and can still serve cached prompts"
)
# Worst first: the attempt's outcome is the worst of its slots'.
_SEVERITY = (ACKNOWLEDGED, ACCEPTED_UNVERIFIED, REFUSED, ERROR, UNREACHABLE)


class LlamacppDialect(Dialect):
    """Erases every slot's KV cache; a busy slot's erase waits for its generation to end."""

    kind = "llamacpp"

    async def reset_once(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        force: bool,
        retry_seconds: float,
        timeout_s: float,
    ) -> Attempt:
        """GET /props for total_slots, then erase every slot at once, each call bounded by what is left."""
        started = time.monotonic()
        props = await engine_call(session, "GET", f"{base_url}/props", timeout_s=timeout_s)
        if props.status is None:
            return _with_warning(failed_attempt(props, props.call.url))
        payload = props.json()
        slots = payload.get("total_slots") if isinstance(payload, dict) else None
        if props.status != 200 or not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            error = f"GET /props answered HTTP {props.status} without a usable total_slots"
            return _with_warning(
                Attempt(ERROR, status=props.status, error=error, url=props.call.url, calls=(props.call,))
            )
        left = max(0.001, timeout_s - (time.monotonic() - started))
        # Slot erases run together: a busy slot's erase blocks until its generation ends, and
        # the others should not queue behind it.
        replies = await asyncio.gather(
            *(
                engine_call(session, "POST", f"{base_url}/slots/{slot}?action=erase", timeout_s=left)
                for slot in range(slots)
            )
        )
        return _with_warning(_fold(props, list(replies), left))


def _slot_outcome(reply: Reply, left: float) -> tuple[str, str | None]:
    """One erase call's outcome and what to say about it."""
    status = reply.status
    if status is None:
        if reply.timed_out:
            return REFUSED, f"an erase still waited on a busy slot after {left:.3g} s"
        return UNREACHABLE, reply.call.error
    if status == 200:
        payload = reply.json()
        if isinstance(payload, dict) and "n_erased" in payload:
            return ACKNOWLEDGED, None
        return ACCEPTED_UNVERIFIED, None
    return outcome_for_status(status)


def _fold(props: Reply, replies: list[Reply], left: float) -> Attempt:
    """The attempt's outcome from every slot's erase: 501 anywhere is unsupported, else the worst slot."""
    calls = (props.call, *(reply.call for reply in replies))
    last = replies[-1]
    if any(reply.status == 501 for reply in replies):
        return unsupported(last.call.url, "HTTP 501: slot actions are switched off", SLOT_SAVE_HINT, calls)
    outcomes = [_slot_outcome(reply, left) for reply in replies]
    outcome, error = max(outcomes, key=lambda pair: _SEVERITY.index(pair[0]))
    success = {ACKNOWLEDGED: True, ACCEPTED_UNVERIFIED: None}.get(outcome, False)
    return Attempt(outcome, status=last.status, success=success, error=error, url=last.call.url, calls=calls)


def _with_warning(attempt: Attempt) -> Attempt:
    """Every llama.cpp answer carries the RAM-cache warning."""
    return replace(attempt, warning=RAM_CACHE_WARNING)
