"""`POST /cache/reset` (SPEC §4): validate, drain, reset with retries, coalesce concurrent calls, answer and record."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.admission import ADMISSION
from proxy.cluster.fanout import cluster_reset
from proxy.config import SETTINGS
from proxy.engine_state import ENGINE
from proxy.engines.base import (
    ACCEPTED_UNVERIFIED,
    ACKNOWLEDGED,
    ERROR,
    REFUSED,
    Attempt,
    AttemptPlan,
    CacheReset,
    Dialect,
    EngineCall,
    EngineInfo,
    EngineKind,
    cache_state_record,
)
from proxy.errors import error_response
from proxy.logs import log_event
from proxy.recorder import RECORDER
from proxy.reset.params import CLUSTER, BadInput, ResetParams, read_params, worst_case_seconds
from proxy.upstream.pools import UPSTREAM_POOL
from proxy.witnesses.canary import Canary, verify_reset
from proxy.witnesses.counters import Sums
from proxy.witnesses.traffic import ResetSummary
from proxy.witnesses.verification import Verification, VerifyMode, answer_of, not_run, record_with

__all__ = [
    "INTERRUPTED_BY_SHUTDOWN",
    "RESETS",
    "RESET_RETRY_INTERVAL_SECONDS",
    "ResetService",
    "handle_reset",
    "retry_reset",
    "setup_reset",
]

log = logging.getLogger("cachewitness.reset")

# vLLM refuses while blocks are held and says callers may retry: every half second, as the reference client.
RESET_RETRY_INTERVAL_SECONDS = 0.5
# The error of a reset that shutdown cut short past the grace period.
INTERRUPTED_BY_SHUTDOWN = "interrupted by shutdown"
# An answer lists every engine call, but a long retry window against llama.cpp makes hundreds:
# keep the first and the last ones and say how many were left out.
_CALLS_HEAD = 16
_CALLS_TAIL = 48


async def _attempt(dialect: Dialect, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
    """One attempt; a dialect that raises (a bug) becomes an `error` outcome instead of a crash."""
    try:
        return await dialect.reset_once(session, plan)
    except Exception as exc:
        log.exception("reset dialect failed", extra={"event": "reset_dialect_failed", "kind": dialect.kind})
        return Attempt(
            ERROR,
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
        retry and attempt.outcome == REFUSED and deadline - time.monotonic() >= RESET_RETRY_INTERVAL_SECONDS
    ):
        await asyncio.sleep(RESET_RETRY_INTERVAL_SECONDS)
        attempts += 1
        plan = replace(plan, retry_seconds=max(0.0, deadline - time.monotonic()))
        attempt = await _attempt(dialect, session, plan)
        calls.extend(attempt.calls)
    return CacheReset.from_attempts(
        attempt, at_ns=at_ns, attempts=attempts, calls=tuple(calls), answered_at_ns=time.time_ns()
    )


def _calls_json(calls: tuple[EngineCall, ...]) -> tuple[list[dict[str, Any]], int]:
    """The answer's calls list, bounded, and how many calls it leaves out."""
    if len(calls) <= _CALLS_HEAD + _CALLS_TAIL:
        return [call.to_json() for call in calls], 0
    kept = calls[:_CALLS_HEAD] + calls[-_CALLS_TAIL:]
    return [call.to_json() for call in kept], len(calls) - len(kept)


@dataclass
class _Caller:
    """One `/cache/reset` call waiting for its answer."""

    params: ResetParams
    answer: asyncio.Future[tuple[int, dict[str, Any]]]


@dataclass
class _Round:
    """One engine reset and the callers who share it; it runs with the first caller's parameters."""

    callers: list[_Caller]
    reset_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Requests carrying it (X-Cachewitness-Case) are this reset's own traffic; only the
    # callers' answers show it, never a record or a log.
    case_token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)

    @property
    def params(self) -> ResetParams:
        """The parameters the engine reset runs with."""
        return self.callers[0].params


@dataclass(frozen=True)
class _Outcome:
    """What a round found: the reset, the engine, and the drain."""

    reset: CacheReset
    engine: EngineInfo
    drain: dict[str, Any]
    verification: Verification


class ResetService:
    """Runs one engine reset at a time; callers arriving during one share the next."""

    def __init__(self, app: web.Application) -> None:
        """The service finds settings, admission, engine, client, witness and evidence on `app`."""
        self._app = app
        self._running: _Round | None = None
        self._next: _Round | None = None
        self._driver: asyncio.Task[None] | None = None
        self._stop_by: float | None = None  # monotonic end of the shutdown's grace period

    @property
    def busy(self) -> bool:
        """True while an engine reset runs."""
        return self._running is not None

    @property
    def waiting(self) -> int:
        """Callers waiting for the next engine reset (they will share it)."""
        return len(self._next.callers) if self._next is not None else 0

    async def reset(self, params: ResetParams) -> tuple[int, dict[str, Any]]:
        """This caller's answer (status, body), from the reset it shares."""
        caller = _Caller(params, asyncio.get_running_loop().create_future())
        if self._running is None:
            self._running = _Round([caller])
            self._driver = asyncio.create_task(self._drive(), name="cachewitness-reset")
        elif self._next is None:
            self._next = _Round([caller])
        else:
            self._next.callers.append(caller)
        # Shielded: a caller who hangs up must not cancel the reset others share.
        return await asyncio.shield(caller.answer)

    def begin_shutdown(self, grace_s: float) -> None:
        """Shutdown began: a reset in progress has `grace_s` from now to finish."""
        self._stop_by = time.monotonic() + grace_s

    async def close(self) -> None:
        """Stop at shutdown, while the upstream pool and the evidence writer are still open.

        The reset in progress (and any caller waiting for the next) may finish until the
        grace period ends; past it the reset is cut short, its drain gate released, and
        each caller answered and recorded `interrupted by shutdown`.
        """
        driver = self._driver
        if driver is None or driver.done():
            return
        stop_by = self._stop_by
        if stop_by is None:  # no `serve` shutdown before it (an app run by a bare runner)
            stop_by = time.monotonic() + self._app[SETTINGS].grace_period
        await asyncio.wait({driver}, timeout=max(0.0, stop_by - time.monotonic()))
        if not driver.done():
            driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await driver

    async def _drive(self) -> None:
        """Run rounds until no caller waits."""
        try:
            while self._running is not None:
                current = self._running
                try:
                    await self._run_round(current)
                except Exception:
                    log.exception(
                        "cache reset failed",
                        extra={"event": "cache_reset_failed", "reset_id": current.reset_id},
                    )
                    _answer_all(
                        current,
                        500,
                        {
                            "error": {
                                "message": "the sidecar failed while resetting; see its log",
                                "type": "server_error",
                                "code": "reset_failed",
                                "param": None,
                            }
                        },
                    )
                self._running, self._next = self._next, None
        finally:
            for pending in (self._running, self._next):
                if pending is not None:
                    for caller in pending.callers:
                        caller.answer.cancel()
            self._running = self._next = None

    async def _run_round(self, current: _Round) -> None:
        """Drain, reset with retries, release, then answer and record for every caller."""
        app = self._app
        settings = app[SETTINGS]
        admission = app[ADMISSION]
        engine = app[ENGINE]
        session = app[UPSTREAM_POOL]
        recorder = app[RECORDER]
        params = current.params
        started_ns = time.time_ns()
        info = engine.info
        drain: dict[str, Any] = {
            "waited_s": 0.0,
            "inflight_at_start": admission.inflight,
            "held": 0,
            "enabled": params.drain,
        }
        hold = None
        try:
            # Detection first: traffic is not held while an unreachable upstream is probed.
            await engine.ensure_detected(session)
            info, dialect = engine.info, engine.dialect
            canary = self._canary(params, info)
            if params.drain:
                # A held request waits out the whole reset at worst: the drain, the retry window,
                # the last attempt — and SGLang's `?timeout=` wait for idle inside that attempt.
                hold = admission.hold(worst_case_seconds(settings, params, canary=isinstance(canary, Canary)))
                drained = await admission.wait_idle(settings.drain_timeout)
                drain = {**drained.to_json(), "enabled": True, "inflight_at_end": drained.inflight_at_end}

            async def engine_reset() -> CacheReset:
                return await retry_reset(
                    dialect,
                    session,
                    settings.upstream_base,
                    force=params.force,
                    retry_seconds=params.retry_seconds,
                    timeout_s=settings.reset_attempt_timeout,
                    retry=params.retry,
                )

            # The case before this reset ends here: its engine counters are read (proxy/witnesses/case.py).
            if recorder.case is not None:
                await recorder.case.reset_started()
            # The canary (inside the drain window) wraps the engine reset: see proxy/witnesses/canary.py.
            if isinstance(canary, Canary):
                reset, verification = await verify_reset(canary, engine_reset)
            else:
                reset, verification = await engine_reset(), not_run(canary)
            if reset.succeeded:
                # Before the gate opens: requests held by the drain belong to this reset.
                recorder.reset_accepted(
                    reset_id=current.reset_id,
                    session_id=params.session_id,
                    case_id=params.case_id,
                    at_ns=reset.answered_at_ns or reset.at_ns,
                    verified=verification.verified,
                    case_token=current.case_token,
                    bind=params.bind,
                )
            if recorder.case is not None:
                await recorder.case.reset_finished(
                    recorder.witness.sequence_ids(), canary.spent if isinstance(canary, Canary) else Sums()
                )
        except asyncio.CancelledError:
            # Only close() cancels a round, past the grace period: answer and record it now,
            # while the evidence writer is still open.
            interrupted = _interrupted(settings.upstream_base, started_ns)
            self._finish(current, _Outcome(interrupted, info, drain, not_run("interrupted by shutdown")))
            raise
        finally:
            if hold is not None:
                admission.release(hold)
        self._finish(current, _Outcome(reset, info, drain, verification))

    def _canary(self, params: ResetParams, engine: EngineInfo) -> Canary | str:
        """The canary that will prove this reset, or why none is sent."""
        settings = self._app[SETTINGS]
        if params.verify == VerifyMode.NONE:
            return "verify none: no canary was sent"
        if not params.drain:
            return "the canary runs inside the drain window only, and this reset had drain false"
        if engine.kind in (EngineKind.NONE, EngineKind.UNKNOWN) or (
            engine.kind == EngineKind.GENERIC and not settings.reset_path
        ):
            return "the engine has no reset to verify"
        return Canary(
            self._app[UPSTREAM_POOL],
            settings.upstream_base,
            engine.kind,
            settings.reset_attempt_timeout,
            count=self._app[RECORDER].canary_request,
            api_key=settings.engine_key,
        )

    def _finish(self, current: _Round, outcome: _Outcome) -> None:
        """Record each caller's record and the reset once, log, and hand out the answers."""
        answers = [
            _answer(caller.params, current, outcome, index) for index, caller in enumerate(current.callers)
        ]
        reset = outcome.reset
        summary = _summary(current, outcome, answers[0][1]["cache_state"])
        self._app[RECORDER].reset_answered(
            (body["cache_state"] for _status, body in answers),
            summary,
            engine_kind=outcome.engine.kind,
            answer=reset.outcome,
            attempts=reset.attempts,
            verified=outcome.verification.verified,
        )
        log_event(
            log,
            logging.INFO if reset.succeeded else logging.WARNING,
            f"cache reset {reset.outcome}",
            event="cache_reset",
            reset_id=current.reset_id,
            answer=reset.outcome,
            engine_kind=outcome.engine.kind,
            engine_version=outcome.engine.version,
            attempts=reset.attempts,
            status=reset.status,
            url=reset.url,
            error=reset.error,
            duration_s=summary.duration_s,
            callers=len(current.callers),
            drain_waited_s=outcome.drain["waited_s"],
            verified=outcome.verification.verified.value,
            verify_reason=outcome.verification.reason,
        )
        for caller, answer in zip(current.callers, answers, strict=True):
            if not caller.answer.done():
                caller.answer.set_result(answer)


def _answer(
    params: ResetParams, current: _Round, outcome: _Outcome, index: int
) -> tuple[int, dict[str, Any]]:
    """One caller's answer (SPEC §4) with its own `infer.cache_state` record."""
    reset, verification = outcome.reset, outcome.verification
    record = cache_state_record(
        session_id=params.session_id,
        case_id=params.case_id,
        requested=params.requested,
        reset=reset,
        warmup_requests=params.warmup_requests,
        reset_id=current.reset_id,
        engine=outcome.engine,
        via=params.via,
    )
    if params.parent_reset_id is not None:
        record["parent_reset_id"] = params.parent_reset_id
    record = record_with(record, reset, verification)
    answer, status = answer_of(reset, verification)
    body: dict[str, Any] = {}
    if answer != ACCEPTED_UNVERIFIED:
        # Absent, not null, when unconfirmed: a client reading `success` must see no field.
        body["success"] = answer == ACKNOWLEDGED
    calls, omitted = _calls_json(reset.calls)
    body.update(
        {
            "answer": answer,
            "verified": verification.verified.value,
            "verification": verification.to_json(),
            "reset_id": current.reset_id,
            "engine": outcome.engine.to_json(),
            "attempts": reset.attempts,
            "at_ns": reset.at_ns,
            "answered_at_ns": reset.answered_at_ns,
            "status": reset.status,
            "url": reset.url,
            "drain": outcome.drain,
            "calls": calls,
            "session_id": params.session_id,
            "case_id": params.case_id,
            "coalesced": index > 0,
            "parent_reset_id": params.parent_reset_id,
            # Only a reset that started a new sequence has traffic of its own to name.
            "case_token": current.case_token if reset.succeeded else None,
            "bind": current.params.bind if reset.succeeded else None,
            "cache_state": record,
        }
    )
    if omitted:
        body["calls_omitted"] = omitted
    if reset.error:
        body["detail"] = reset.error
    hint = verification.hint or reset.hint
    if hint:
        body["hint"] = hint
    if reset.warning:
        body["warning"] = reset.warning
    return status, body


def _summary(current: _Round, outcome: _Outcome, first_record: dict[str, Any]) -> ResetSummary:
    """What the witness is told once per engine reset."""
    reset = outcome.reset
    answered = reset.answered_at_ns or reset.at_ns
    return ResetSummary(
        reset_id=current.reset_id,
        answer=answer_of(reset, outcome.verification)[0],
        verified=outcome.verification.verified.value,
        verification=outcome.verification.to_json(),
        reference_answer=reset.answer,
        succeeded=reset.succeeded,
        acknowledged=reset.acknowledged,
        engine=outcome.engine.to_json(),
        attempts=reset.attempts,
        status=reset.status,
        url=reset.url,
        error=reset.error,
        hint=reset.hint,
        warning=reset.warning,
        at_ns=reset.at_ns,
        answered_at_ns=reset.answered_at_ns,
        duration_s=max(0, answered - reset.at_ns) / 1e9,
        drain=outcome.drain,
        session_id=current.params.session_id,
        case_id=current.params.case_id,
        callers=tuple(
            {"session_id": c.params.session_id, "case_id": c.params.case_id} for c in current.callers
        ),
        cache_state=first_record,
    )


def _answer_all(current: _Round, status: int, body: dict[str, Any]) -> None:
    """Give every caller of a round the same answer."""
    for caller in current.callers:
        if not caller.answer.done():
            caller.answer.set_result((status, body))


def _interrupted(url: str, at_ns: int) -> CacheReset:
    """The outcome of a round that shutdown cut short: whether the engine reset is not known."""
    cut_short = Attempt(ERROR, error=INTERRUPTED_BY_SHUTDOWN, url=url)
    return CacheReset.from_attempts(
        cut_short, at_ns=at_ns, attempts=0, calls=(), answered_at_ns=time.time_ns()
    )


RESETS = web.AppKey("resets", ResetService)


def setup_reset(app: web.Application) -> None:
    """The reset service: stopped at shutdown before the pool and the evidence writer it uses.

    `serve` calls `begin_shutdown` when the grace period starts, so a reset under way gets
    the same grace period as the requests in flight, not a second one when its turn comes.
    """
    service = ResetService(app)
    app[RESETS] = service

    async def lifetime(_app: web.Application) -> AsyncIterator[None]:
        yield
        await service.close()

    app.cleanup_ctx.append(lifetime)


async def handle_reset(request: web.Request) -> web.Response:
    """`POST /cache/reset`: a 400 naming the field for bad input, else the answer of SPEC §4."""
    try:
        params = await read_params(request, request.app[SETTINGS])
    except BadInput as bad:
        return error_response(400, bad.message, type_="invalid_request_error", code=bad.code, param=bad.param)
    if params.scope == CLUSTER:
        return await cluster_reset(request, params)
    status, body = await request.app[RESETS].reset(params)
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")
