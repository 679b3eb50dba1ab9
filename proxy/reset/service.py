"""The reset service: one engine reset at a time, concurrent callers coalesced, drained, answered and recorded.

A round's stages (detect, layout, plan, drain, reset, judge, record) are in stages.py, the
retry loop in retry.py, the answers in answer.py, the `POST /cache/reset` handler in
proxy/admin/views.py (docs/reset.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from proxy.admission import ADMISSION
from proxy.config import SETTINGS
from proxy.logs import log_event
from proxy.recorder import RECORDER
from proxy.reset.answer import Caller, Round, RoundOutcome, answer_all, caller_answer, reset_summary
from proxy.reset.params import ResetParams
from proxy.reset.retry import INTERRUPTED_BY_SHUTDOWN, interrupted
from proxy.reset.stages import RoundStages
from proxy.witnesses.verification import not_run

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
        self._stages = RoundStages(app)

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
        """The round's stages in order (proxy/reset/stages.py), the drain's hold released
        whatever happens, then every caller answered and recorded."""
        run = self._stages.begin(current)
        try:
            for stage in self._stages.stages:
                await stage(run)
        except asyncio.CancelledError:
            # Only close() cancels a round, past the grace period: answer and record it now,
            # while the evidence writer is still open.
            cut_short = interrupted(self._app[SETTINGS].upstream_base, run.started_ns)
            self._finish(
                current, RoundOutcome(cut_short, run.info, run.drain, not_run(INTERRUPTED_BY_SHUTDOWN))
            )
            raise
        finally:
            if run.hold is not None:
                self._app[ADMISSION].release(run.hold)
        self._finish(current, run.outcome())

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
