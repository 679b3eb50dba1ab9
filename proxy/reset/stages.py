"""One round's stages, in order: detect → layout → plan → drain → reset → judge → record.

Each stage reads and fills one `RoundRun`, the round as it goes; the service runs the list
(`RoundStages.stages`), releases the drain's hold whatever happens, then answers every caller
(proxy/reset/service.py). A stage that raises ends the round there: the service answers 500.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from proxy.admission import ADMISSION, Hold
from proxy.config import SETTINGS
from proxy.engine_state import ENGINE
from proxy.engines.base import CacheReset, Dialect, EngineInfo
from proxy.engines.modes import EngineMode
from proxy.engines.topology import Topology, read_topology
from proxy.recorder import RECORDER
from proxy.reset.answer import Round, RoundOutcome
from proxy.reset.layout import TierClears, judged, tier_clears
from proxy.reset.params import ResetParams, worst_case_seconds
from proxy.reset.retry import retry_reset
from proxy.reset.silent import events_until_cleared, verify_until_cold
from proxy.upstream.pools import UPSTREAM_POOL
from proxy.vocabulary import EngineKind, VerifyMode
from proxy.witnesses.canary import Canary, CanaryFit, verify_reset
from proxy.witnesses.counters import Sums
from proxy.witnesses.kv_events.witness import EventsCheck, merged
from proxy.witnesses.ranks import spent, verify_ranks
from proxy.witnesses.tiers import read_by_tier, storage_tier
from proxy.witnesses.verification import Verification, not_run

__all__ = ["RoundRun", "RoundStages", "Stage", "with_counters"]


@dataclass
class RoundRun:
    """One round as its stages fill it in; `outcome` is what the callers are answered from."""

    current: Round
    info: EngineInfo  # the engine as detected (detect), else as known when the round began
    drain: dict[str, Any]  # what the drain waited for (drain), else that it did not run
    started_ns: int = field(default_factory=time.time_ns)
    dialect: Dialect | None = None  # detect
    topology: Topology = field(default_factory=Topology)  # layout
    # layout: the clears of tiers the engine's reset does not reach (SGLang's storage, LMCache)
    clears: TierClears | None = None
    canary: Canary | str = "no canary was planned"  # plan: the canary, or why none is sent
    ranked: list[Canary | str] = field(default_factory=list)  # plan: one per data-parallel rank
    events: EventsCheck | None = None  # plan: the KV events witness, when it runs
    hold: Hold | None = None  # drain: the hold on new requests, released by the service
    reset: CacheReset | None = None  # reset
    verification: Verification | None = None  # reset, then judge and record

    @property
    def params(self) -> ResetParams:
        """The parameters the round runs with (its first caller's)."""
        return self.current.params

    def canaries(self) -> list[Canary]:
        """The canaries sent: one per data-parallel rank, else the one; none when none is planned."""
        if not isinstance(self.canary, Canary):
            return []
        return [c for c in self.ranked if isinstance(c, Canary)] or [self.canary]

    def outcome(self) -> RoundOutcome:
        """The round as its callers are answered, once the reset stage has run."""
        if self.reset is None or self.verification is None:
            raise RuntimeError("a round answered before its reset ran")
        return RoundOutcome(self.reset, self.info, self.drain, self.verification)


Stage = Callable[[RoundRun], Awaitable[None]]


class RoundStages:
    """The stages of every round, over the app's settings, drain gate, engine, pool and recorder."""

    def __init__(self, app: web.Application) -> None:
        self._app = app
        self._settings = app[SETTINGS]
        self._canary_fit = CanaryFit()  # the engine's tokens per canary word, learned reset by reset
        self._storage_tier = "external"  # the engine's storage tier, as the last reset's layout said

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages in the order they run."""
        return (self.detect, self.layout, self.plan, self.drain, self.reset, self.judge, self.record)

    def begin(self, current: Round) -> RoundRun:
        """The round before its first stage."""
        params = current.params
        drain = {"waited_s": 0.0, "inflight_at_start": self._app[ADMISSION].inflight, "held": 0}
        return RoundRun(current, self._app[ENGINE].info, {**drain, "enabled": params.drain})

    async def detect(self, run: RoundRun) -> None:
        """The engine, detected again if start-up could not reach it; no traffic is held meanwhile."""
        engine = self._app[ENGINE]
        await engine.ensure_detected(self._app[UPSTREAM_POOL])
        run.info, run.dialect = engine.info, engine.dialect

    async def layout(self, run: RoundRun) -> None:
        """The engine's ranks and its tiers beyond the engine's own reset, read before any traffic is held."""
        settings, session = self._settings, self._app[UPSTREAM_POOL]
        base, timeout_s, key = settings.upstream_base, settings.reset_attempt_timeout, settings.engine_key
        run.topology = await read_topology(session, base, run.info.kind, timeout_s, key)
        run.clears = tier_clears(session, settings, run.info, run.topology)
        # The tier SGLang's per-tier counter calls `storage` (its HiCache backend's).
        self._storage_tier = storage_tier(run.topology.storage_backend or "")

    async def plan(self, run: RoundRun) -> None:
        """The witnesses this round sends: the canary (one per rank) and the KV events witness."""
        run.canary = self._canary(run.params, run.info)
        if run.topology.multi_rank:
            run.ranked = [self._canary(run.params, run.info, rank) for rank in run.topology.ranks]
        run.events = self._events(run.params)

    async def drain(self, run: RoundRun) -> None:
        """With drain: new requests held, then the ones in flight waited for."""
        if not run.params.drain:
            return
        admission = self._app[ADMISSION]
        # A held request waits out the whole reset at worst: the drain, the retry window,
        # the last attempt — and SGLang's `?timeout=` wait for idle inside that attempt.
        worst = worst_case_seconds(
            self._settings, run.params, canary=bool(run.canaries()), ranks=max(1, len(run.ranked))
        )
        run.hold = admission.hold(worst)
        drained = await admission.wait_idle(self._settings.drain_timeout)
        run.drain = {**drained.to_json(), "enabled": True, "inflight_at_end": drained.inflight_at_end}

    async def reset(self, run: RoundRun) -> None:
        """The engine reset with retries, inside its witnesses: the KV events witness wraps the
        engine reset (marker, reset, flush probe, clear) and the canary wraps both
        (proxy/witnesses/kv_events/witness.py, canary.py)."""
        case = self._app[RECORDER].case
        if case is not None:  # the case before this reset ends here: its engine counters are read
            await case.reset_started()
        engine_reset = self._engine_reset(run)
        witnessed = run.events.wrap(engine_reset) if run.events is not None else engine_reset
        canaries, params, info = run.canaries(), run.params, run.info
        # An engine that refuses in silence (a bare 200) is reset again within the retry window
        # until a witness sees the cache cold (proxy/reset/silent.py).
        silent = run.dialect is not None and run.dialect.silent_refusals and params.retry
        window_s = max(0.0, params.retry_seconds - (time.time_ns() - run.started_ns) / 1e9)
        if isinstance(run.canary, str):  # why no canary was sent
            if run.events is not None and silent:
                again = lambda: self._events(params)  # noqa: E731
                reset, run.events = await events_until_cleared(
                    run.events, again, engine_reset, window_s=window_s
                )
            else:
                reset = await witnessed()
            verification = not_run(run.canary)
        elif len(canaries) > 1:  # every data-parallel rank proven on its own
            reset, verification = await verify_ranks(canaries, witnessed)
        elif silent:
            fresh = lambda: self._fresh_canary(params, info)  # noqa: E731
            reset, verification = await verify_until_cold(canaries[0], fresh, witnessed, window_s=window_s)
        else:
            reset, verification = await verify_reset(canaries[0], witnessed)
        if run.events is not None:
            if canaries and reset.succeeded:
                await run.events.settle()  # the canary's last reset: its clear, before a case starts
            verification = merged(run.params.verify, verification, run.events.report)
            reset = replace(reset, calls=(*reset.calls, *run.events.calls))
        run.reset, run.verification = reset, verification

    async def judge(self, run: RoundRun) -> None:
        """The verification with what each cache tier and rank was asked and found."""
        verification = self._verification(run)
        reset = run.reset
        run.verification = judged(
            verification,
            run.info,
            run.topology,
            run.clears,
            events_ran=run.events is not None,
            unsupported_tiers=reset.unsupported_tiers if reset is not None else (),
        )

    async def record(self, run: RoundRun) -> None:
        """An accepted reset numbers the requests after it, before the gate opens (the requests the
        drain held belong to it); the case's engine counters are read, inside the drain window."""
        recorder, params, reset = self._app[RECORDER], run.params, run.reset
        if reset is not None and reset.succeeded:
            recorder.reset_accepted(
                reset_id=run.current.reset_id,
                session_id=params.session_id,
                case_id=params.case_id,
                at_ns=reset.answered_at_ns or reset.at_ns,
                verified=self._verification(run).verified,
                case_token=run.current.case_token,
                bind=params.bind,
            )
        if recorder.case is None:
            return
        canaries = run.canaries()
        counters = await recorder.case.reset_finished(
            recorder.witness.sequence_ids(), spent(canaries) if canaries else Sums()
        )
        # Not with the events witness, whose flush probe has no token counts.
        if counters is not None and params.drain and run.events is None:
            run.verification = with_counters(self._verification(run), counters)

    def _engine_reset(self, run: RoundRun) -> Callable[[], Awaitable[CacheReset]]:
        """The engine reset with its retries, then the tier clears where they run."""
        settings, params, dialect, clears = self._settings, run.params, run.dialect, run.clears
        if dialect is None:
            raise RuntimeError("a round reset before its engine was detected")

        async def engine_reset() -> CacheReset:
            done = await retry_reset(
                dialect,
                self._app[UPSTREAM_POOL],
                settings.upstream_base,
                force=params.force,
                retry_seconds=params.retry_seconds,
                timeout_s=settings.reset_attempt_timeout,
                retry=params.retry,
            )
            return await clears.after(done) if clears is not None else done

        return engine_reset

    @staticmethod
    def _verification(run: RoundRun) -> Verification:
        if run.verification is None:
            raise RuntimeError("a round judged before its reset ran")
        return run.verification

    def _canary(self, params: ResetParams, engine: EngineInfo, rank: int | None = None) -> Canary | str:
        """The canary that will prove this reset (on one data-parallel rank), or why none is sent."""
        settings = self._settings
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
        events = self._app[RECORDER].kv_events
        if events is None or not events.running or params.verify not in (VerifyMode.EVENTS, VerifyMode.BOTH):
            return None
        settings, case = self._settings, self._app[RECORDER].case
        return EventsCheck(
            events,
            self._app[UPSTREAM_POOL],
            settings.upstream_base,
            settings.reset_attempt_timeout,
            api_key=settings.engine_key,
            restart_seen=case.restarted_since if case is not None else None,
        )


def with_counters(verification: Verification, counters: dict[str, Any]) -> Verification:
    """`witnesses` with the counters block, and the canary's own where only the canary ran before."""
    named = dict(verification.witnesses)
    if verification.method == VerifyMode.CANARY and "canary" not in named:
        own = replace(verification, witnesses={}, tiers=None, ranks=()).to_json()
        named["canary"] = {"result": verification.verified.value, **own}
    named["counters"] = counters
    return replace(verification, witnesses=named)
