"""The reset service: one engine reset at a time, concurrent callers coalesced, drained, answered and recorded.

The retry loop is in retry.py, the answers in answer.py, the `POST /cache/reset` handler in
proxy/admin/views.py (docs/reset.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from aiohttp import web

from proxy.admission import ADMISSION
from proxy.config import SETTINGS
from proxy.engine_state import ENGINE
from proxy.engines.base import CacheReset, EngineInfo
from proxy.engines.modes import EngineMode
from proxy.engines.topology import read_topology
from proxy.logs import log_event
from proxy.recorder import RECORDER
from proxy.reset.answer import Caller, Round, RoundOutcome, answer_all, caller_answer, reset_summary
from proxy.reset.layout import judged, tier_clears
from proxy.reset.params import ResetParams, worst_case_seconds
from proxy.reset.retry import INTERRUPTED_BY_SHUTDOWN, interrupted, retry_reset
from proxy.reset.silent import events_until_cleared, verify_until_cold
from proxy.upstream.pools import UPSTREAM_POOL
from proxy.vocabulary import EngineKind, VerifyMode
from proxy.witnesses.canary import Canary, CanaryFit, verify_reset
from proxy.witnesses.counters import Sums
from proxy.witnesses.events_index import CACHE_INDEX
from proxy.witnesses.events_witness import EventsCheck, merged
from proxy.witnesses.ranks import spent, verify_ranks
from proxy.witnesses.tiers import read_by_tier, storage_tier
from proxy.witnesses.verification import Verification, not_run

__all__ = ["RESETS", "ResetService", "setup_reset"]

log = logging.getLogger("cachewitness.reset")


class ResetService:
    """Runs one engine reset at a time; callers arriving during one share the next."""

    def __init__(self, app: web.Application) -> None:
        """The service finds settings, admission, engine, client, witness and evidence on `app`."""
        self._app = app
        self._running: Round | None = None
        self._next: Round | None = None
        self._driver: asyncio.Task[None] | None = None
        self._stop_by: float | None = None  # monotonic end of the shutdown's grace period
        self._canary_fit = CanaryFit()  # the engine's tokens per canary word, learned reset by reset
        self._storage_tier = "external"  # the engine's storage tier, as the last reset's layout said

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
        caller = Caller(params, asyncio.get_running_loop().create_future())
        if self._running is None:
            self._running = Round([caller])
            self._driver = asyncio.create_task(self._drive(), name="cachewitness-reset")
        elif self._next is None:
            self._next = Round([caller])
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
                    answer_all(
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

    async def _run_round(self, current: Round) -> None:
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
            # The layout (ranks, SGLang's storage tier) before any traffic is held.
            topology = await read_topology(
                session,
                settings.upstream_base,
                info.kind,
                settings.reset_attempt_timeout,
                settings.engine_key,
            )
            # The tier SGLang's per-tier counter calls `storage` (its HiCache backend's).
            self._storage_tier = storage_tier(topology.storage_backend or "")
            canary = self._canary(params, info)
            ranked = (
                [self._canary(params, info, rank) for rank in topology.ranks] if topology.multi_rank else []
            )
            # The tiers the engine's own reset does not reach: SGLang's HiCache storage, LMCache.
            storage = tier_clears(session, settings, info, topology)
            if params.drain:
                # A held request waits out the whole reset at worst: the drain, the retry window,
                # the last attempt — and SGLang's `?timeout=` wait for idle inside that attempt.
                worst = worst_case_seconds(
                    settings, params, canary=isinstance(canary, Canary), ranks=max(1, len(ranked))
                )
                hold = admission.hold(worst)
                drained = await admission.wait_idle(settings.drain_timeout)
                drain = {**drained.to_json(), "enabled": True, "inflight_at_end": drained.inflight_at_end}

            async def engine_reset() -> CacheReset:
                done = await retry_reset(
                    dialect,
                    session,
                    settings.upstream_base,
                    force=params.force,
                    retry_seconds=params.retry_seconds,
                    timeout_s=settings.reset_attempt_timeout,
                    retry=params.retry,
                )
                return await storage.after(done) if storage is not None else done

            # The case before this reset ends here: its engine counters are read (proxy/witnesses/case.py).
            if recorder.case is not None:
                await recorder.case.reset_started()
            # The events witness wraps the engine reset (marker, reset, flush probe, clear), and the
            # canary (inside the drain window) wraps both: proxy/witnesses/events_witness.py, canary.py.
            events = self._events(params)
            witnessed = events.wrap(engine_reset) if events is not None else engine_reset
            if isinstance(canary, Canary):
                canaries = [c for c in ranked if isinstance(c, Canary)] or [canary]
                if len(canaries) > 1:  # every data-parallel rank proven on its own
                    reset, verification = await verify_ranks(canaries, witnessed)
                elif dialect.silent_refusals and params.retry:
                    reset, verification = await verify_until_cold(
                        canary,
                        lambda: self._fresh_canary(params, info),
                        witnessed,
                        window_s=max(0.0, params.retry_seconds - (time.time_ns() - started_ns) / 1e9),
                    )
                else:
                    reset, verification = await verify_reset(canary, witnessed)
                if events is not None and reset.succeeded:
                    await events.settle()  # the canary's last reset: its clear, before a case starts
            elif events is not None and dialect.silent_refusals and params.retry:
                left = params.retry_seconds - (time.time_ns() - started_ns) / 1e9
                reset, events = await events_until_cleared(
                    events, lambda: self._events(params), engine_reset, window_s=left
                )
                verification = not_run(canary)
            else:
                reset, verification = await witnessed(), not_run(canary)
            if events is not None:
                verification = merged(params.verify, verification, events.report)
                reset = replace(reset, calls=(*reset.calls, *events.calls))
            verification = judged(
                verification,
                info,
                topology,
                storage,
                events_ran=events is not None,
                unsupported_tiers=reset.unsupported_tiers,
            )
            index = app.get(CACHE_INDEX)
            if index is not None and reset.succeeded:
                index.reset_answered(
                    reset_id=current.reset_id,
                    session_id=params.session_id,
                    case_id=params.case_id,
                    verified=verification.verified,
                )
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
                counters = await recorder.case.reset_finished(
                    recorder.witness.sequence_ids(),
                    spent([c for c in ranked if isinstance(c, Canary)] or [canary])
                    if isinstance(canary, Canary)
                    else Sums(),
                )
                # Inside a drain window only; not with the events witness, whose flush probe has no token counts.
                if counters is not None and params.drain and events is None:
                    verification = with_counters(verification, counters)
        except asyncio.CancelledError:
            # Only close() cancels a round, past the grace period: answer and record it now,
            # while the evidence writer is still open.
            cut_short = interrupted(settings.upstream_base, started_ns)
            self._finish(current, RoundOutcome(cut_short, info, drain, not_run(INTERRUPTED_BY_SHUTDOWN)))
            raise
        finally:
            if hold is not None:
                admission.release(hold)
        self._finish(current, RoundOutcome(reset, info, drain, verification))

    def _canary(self, params: ResetParams, engine: EngineInfo, rank: int | None = None) -> Canary | str:
        """The canary that will prove this reset (on one data-parallel rank), or why none is sent."""
        settings = self._app[SETTINGS]
        if params.verify in (VerifyMode.NONE, VerifyMode.EVENTS):
            return f"verify {params.verify.value}: no canary was sent"
        if not params.drain:
            return "the canary runs inside the drain window only, and this reset had drain false"
        if engine.kind == EngineKind.UNKNOWN:
            return "the engine was not reached: no canary was sent"
        no_reset = engine.kind == EngineKind.NONE or engine.mode == EngineMode.ROUTER
        if no_reset or (engine.kind == EngineKind.GENERIC and not settings.reset_path):
            return "the engine has no reset to verify"
        storage = self._storage_tier
        session, base, kind, timeout_s, key = (
            self._app[UPSTREAM_POOL],
            settings.upstream_base,
            engine.kind,
            settings.reset_attempt_timeout,
            settings.engine_key,
        )
        return Canary(
            session,
            base,
            kind,
            timeout_s,
            count=self._app[RECORDER].canary_request,
            api_key=key,
            read_tiers=lambda: read_by_tier(session, base, kind, timeout_s, key, storage),
            rank=rank,
            fit=self._canary_fit,
        )

    def _fresh_canary(self, params: ResetParams, engine: EngineInfo) -> Canary:
        """Another canary for a retried round (fresh prompts: the last ones are known warm)."""
        canary = self._canary(params, engine)
        assert isinstance(canary, Canary)  # the same reset made one before
        return canary

    def _events(self, params: ResetParams) -> EventsCheck | None:
        """The events witness for this reset, None without kv_events_endpoint or when not asked."""
        index = self._app.get(CACHE_INDEX)
        if (
            index is None
            or not index.events.running
            or params.verify not in (VerifyMode.EVENTS, VerifyMode.BOTH)
        ):
            return None
        settings = self._app[SETTINGS]
        case = self._app[RECORDER].case
        return EventsCheck(
            index.events,
            self._app[UPSTREAM_POOL],
            settings.upstream_base,
            settings.reset_attempt_timeout,
            api_key=settings.engine_key,
            restart_seen=case.restarted_since if case is not None else None,
        )

    def _finish(self, current: Round, outcome: RoundOutcome) -> None:
        """Record each caller's record and the reset once, log, and hand out the answers."""
        answers = [
            caller_answer(caller.params, current, outcome, index)
            for index, caller in enumerate(current.callers)
        ]
        reset = outcome.reset
        summary = reset_summary(current, outcome, answers[0][1]["cache_state"])
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


def with_counters(verification: Verification, counters: dict[str, Any]) -> Verification:
    """`witnesses` with the counters block, and the canary's own where only the canary ran before."""
    named = dict(verification.witnesses)
    if verification.method == VerifyMode.CANARY and "canary" not in named:
        own = replace(verification, witnesses={}, tiers=None, ranks=()).to_json()
        named["canary"] = {"result": verification.verified.value, **own}
    named["counters"] = counters
    return replace(verification, witnesses=named)


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
