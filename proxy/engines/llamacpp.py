"""llama.cpp `llama-server`: erase every slot, `POST /slots/{i}?action=erase` (ENGINES.md, llama.cpp)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import aiohttp

from proxy.engines.base import Attempt, AttemptPlan, Dialect, failed_attempt, outcome_for_status, unsupported
from proxy.engines.call import Reply, bearer, engine_call
from proxy.engines.routes import control, control_prefix
from proxy.vocabulary import EngineKind, ResetAnswer

__all__ = [
    "CONTROL_ROUTES",
    "ERASE_FLOOR_SECONDS",
    "RAM_CACHE_WARNING",
    "SLOT_ERASE",
    "LlamacppDialect",
    "erase_attempt",
]

# llama-server b10434 (tools/server/server.cpp route table): slot save/restore/erase and the
# slot list (which shows prompts), props and LoRA changes, router-mode model load/unload,
# and the web UI's CORS proxy (it fetches any URL it is given).
CONTROL_ROUTES = (
    control_prefix("/slots"),
    control("/props", "POST"),
    control("/lora-adapters", "POST"),
    control_prefix("/models/load"),
    control_prefix("/models/unload"),
    control("/models", "POST", "DELETE"),
    control("/cors-proxy"),
)
# `POST /slots/{id}?action=erase` is forwarded and recorded, never invisible.
SLOT_ERASE = control_prefix("/slots/", "POST")

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
# An idle slot's erase answers in milliseconds; an erase gets at least this long, even when
# the retry window is spent, so that the last attempt can still succeed.
ERASE_FLOOR_SECONDS = 0.5
# Worst first: the attempt's outcome is the worst of its slots'.
_SEVERITY = (
    ResetAnswer.ACKNOWLEDGED,
    ResetAnswer.ACCEPTED_UNVERIFIED,
    ResetAnswer.REFUSED,
    ResetAnswer.ERROR,
    ResetAnswer.UNREACHABLE,
)
# `success` of an erase round: acknowledged, unconfirmed (None), else refused.
_SUCCESS: dict[ResetAnswer, bool | None] = {
    ResetAnswer.ACKNOWLEDGED: True,
    ResetAnswer.ACCEPTED_UNVERIFIED: None,
}


class LlamacppDialect(Dialect):
    """Erases every slot's KV cache; a slot that is generating is a refusal, retried by the caller.

    llama-server never refuses an erase: a busy slot's erase is deferred and the call
    blocks until the generation ends, which can be minutes. So the attempt first reads
    `GET /slots` and refuses while a slot `is_processing`, and bounds every erase by what
    is left of the retry window: an erase that still waits then is refused too.
    """

    kind = EngineKind.LLAMACPP
    control_routes = CONTROL_ROUTES

    def __init__(self, api_key: str | None = None) -> None:
        """`api_key`: the engine's own key (`--api-key`), sent as a bearer token, if it has one."""
        self._headers = bearer(api_key)

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """GET /props for total_slots, GET /slots for busy ones, then erase every slot at once."""
        started = time.monotonic()
        props = await engine_call(
            session, "GET", f"{plan.base_url}/props", timeout_s=plan.timeout_s, headers=self._headers
        )
        slots = _total_slots(props)
        if props.status is None:
            return _with_warning(failed_attempt(props, props.call.url))
        if slots is None:
            error = f"GET /props answered HTTP {props.status} without a usable total_slots"
            return _with_warning(
                Attempt(
                    ResetAnswer.ERROR,
                    status=props.status,
                    error=error,
                    url=props.call.url,
                    calls=(props.call,),
                )
            )
        listing = await engine_call(
            session, "GET", f"{plan.base_url}/slots", timeout_s=plan.timeout_s, headers=self._headers
        )
        if listing.status is None and not listing.timed_out:
            return _with_warning(failed_attempt(listing, listing.call.url))
        busy = _busy_slots(listing)
        if busy or listing.timed_out:
            what = f"slot {', '.join(map(str, busy))} generating" if busy else "GET /slots did not answer"
            error = f"{what}: a busy slot's erase would wait for its generation to end"
            calls = (props.call, listing.call)
            return _with_warning(
                Attempt(
                    ResetAnswer.REFUSED, status=listing.status, error=error, url=listing.call.url, calls=calls
                )
            )
        spent = time.monotonic() - started
        left = max(0.001, min(plan.timeout_s - spent, max(plan.retry_seconds - spent, ERASE_FLOOR_SECONDS)))
        # Slot erases run together: should a slot turn busy after all, its erase blocks until
        # the generation ends, and the others should not queue behind it.
        replies = await asyncio.gather(
            *(
                engine_call(
                    session,
                    "POST",
                    f"{plan.base_url}/slots/{slot}?action=erase",
                    timeout_s=left,
                    headers=self._headers,
                )
                for slot in range(slots)
            )
        )
        return _with_warning(_fold((props, listing), list(replies), left))


def _total_slots(props: Reply) -> int | None:
    """`total_slots` from a 200 `/props` answer, None when it has no usable one."""
    payload = props.json()
    slots = payload.get("total_slots") if isinstance(payload, dict) else None
    if props.status != 200 or not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        return None
    return slots


def _busy_slots(listing: Reply) -> list[int]:
    """The ids of the slots `GET /slots` says are processing (none when it is not served: `--no-slots`)."""
    payload: Any = listing.json() if listing.status == 200 else None
    if not isinstance(payload, list):
        return []
    return [
        slot.get("id", index)
        for index, slot in enumerate(payload)
        if isinstance(slot, dict) and slot.get("is_processing") is True
    ]


def _slot_outcome(reply: Reply, left: float) -> tuple[ResetAnswer, str | None]:
    """One erase call's outcome and what to say about it."""
    status = reply.status
    if status is None:
        if reply.timed_out:
            return ResetAnswer.REFUSED, f"an erase still waited on a busy slot after {left:.3g} s"
        return ResetAnswer.UNREACHABLE, reply.call.error
    if status == 200:
        payload = reply.json()
        if isinstance(payload, dict) and "n_erased" in payload:
            return ResetAnswer.ACKNOWLEDGED, None
        return ResetAnswer.ACCEPTED_UNVERIFIED, None
    return outcome_for_status(status)


def erase_attempt(reply: Reply) -> Attempt:
    """The outcome of one slot erase a client made through the sidecar (no timeout of ours)."""
    if reply.status is None:
        return failed_attempt(reply, reply.call.url)
    if reply.status == 501:
        return unsupported(
            reply.call.url, "HTTP 501: slot actions are switched off", SLOT_SAVE_HINT, (reply.call,)
        )
    outcome, error = _slot_outcome(reply, 0.0)
    return Attempt(
        outcome,
        status=reply.status,
        success=_SUCCESS.get(outcome, False),
        error=error,
        url=reply.call.url,
        calls=(reply.call,),
    )


def _fold(looked_up: tuple[Reply, ...], replies: list[Reply], left: float) -> Attempt:
    """The attempt's outcome from every slot's erase: 501 anywhere is unsupported, else the worst slot."""
    calls = (*(reply.call for reply in looked_up), *(reply.call for reply in replies))
    last = replies[-1]
    if any(reply.status == 501 for reply in replies):
        return unsupported(last.call.url, "HTTP 501: slot actions are switched off", SLOT_SAVE_HINT, calls)
    outcomes = [_slot_outcome(reply, left) for reply in replies]
    outcome, error = max(outcomes, key=lambda pair: _SEVERITY.index(pair[0]))
    success = _SUCCESS.get(outcome, False)
    return Attempt(outcome, status=last.status, success=success, error=error, url=last.call.url, calls=calls)


def _with_warning(attempt: Attempt) -> Attempt:
    """Every llama.cpp answer carries the RAM-cache warning."""
    return replace(attempt, warning=RAM_CACHE_WARNING)
