"""Which engine the sidecar fronts now, and the dialect that resets it (re-detected when the upstream returns)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from proxy.config import SETTINGS, Settings
from proxy.engines.base import Dialect, EngineInfo
from proxy.engines.detect import (
    UndetectedDialect,
    detect_engine,
    probe_info,
)
from proxy.engines.dynamo import DynamoDialect
from proxy.engines.generic import GenericDialect
from proxy.engines.llamacpp import LlamacppDialect
from proxy.engines.mindnano import MindnanoDialect
from proxy.engines.modes import EngineMode, LlamacppRouterDialect, VllmRustDialect
from proxy.engines.none import NoResetDialect
from proxy.engines.sglang import SglangDialect
from proxy.engines.trtllm import TrtllmDialect
from proxy.engines.vllm import VllmDialect
from proxy.logs import log_event
from proxy.redact import redact_url
from proxy.upstream.pools import UPSTREAM_POOL
from proxy.vocabulary import EngineKind

__all__ = ["ENGINE", "EngineState", "make_dialect", "redetector", "setup_engine_state"]

log = logging.getLogger("cachewitness.engine")


def make_dialect(kind: EngineKind, settings: Settings, mode: str | None = None) -> Dialect:
    """The dialect for an engine kind (and mode), configured from settings (unknown kinds get the generic one)."""
    key = settings.engine_key
    if kind == EngineKind.VLLM:
        return VllmRustDialect(api_key=key) if mode == EngineMode.RUST_FRONTEND else VllmDialect(api_key=key)
    if kind == EngineKind.SGLANG:
        return SglangDialect(api_key=key)
    if kind == EngineKind.LLAMACPP:
        return LlamacppRouterDialect() if mode == EngineMode.ROUTER else LlamacppDialect(api_key=key)
    if kind == EngineKind.MINDNANO:
        return MindnanoDialect(api_key=key)
    if kind == EngineKind.TRTLLM:
        return TrtllmDialect(api_key=key)
    if kind == EngineKind.DYNAMO:
        return DynamoDialect(api_key=key)
    if kind == EngineKind.UNKNOWN:
        return UndetectedDialect()
    if kind == EngineKind.NONE:
        return NoResetDialect(health_path=settings.health_path or "/health")
    return GenericDialect(
        reset_method=settings.reset_method,
        reset_path=settings.reset_path,
        busy_statuses=settings.busy_statuses,
        success_field=settings.success_field,
        health_path=settings.health_path or "/health",
        api_key=key,
    )


class EngineState:
    """The engine's kind and version, and its dialect; `--engine auto` detects at start and on return."""

    def __init__(self, settings: Settings) -> None:
        """Start undetected (auto) or with the configured kind."""
        self._settings = settings
        self._auto = settings.engine == "auto"
        kind = EngineKind.UNKNOWN if self._auto else EngineKind(settings.engine)
        self.info = EngineInfo(kind)
        self.dialect: Dialect = make_dialect(kind, settings)
        self._lock = asyncio.Lock()

    @property
    def health_path(self) -> str:
        """The upstream health path: configured, else the dialect's."""
        return self._settings.health_path or self.dialect.health_path

    @property
    def detected(self) -> bool:
        """False while `--engine auto` has not yet reached the upstream."""
        return self.info.kind != EngineKind.UNKNOWN

    async def detect(self, session: aiohttp.ClientSession) -> EngineInfo:
        """Detect (auto) or probe the configured kind's version (best effort); log what was found. Never raises."""
        settings = self._settings
        timeout_s = settings.connect_timeout or 5.0
        async with self._lock:
            if self._auto:
                info = await detect_engine(
                    session, settings.upstream_base, timeout_s, api_key=settings.engine_key
                )
            else:
                info = await probe_info(
                    session,
                    settings.upstream_base,
                    EngineKind(settings.engine),
                    timeout_s,
                    api_key=settings.engine_key,
                )
            self.info = info
            self.dialect = make_dialect(info.kind, settings, info.mode)
        level = logging.WARNING if info.kind == EngineKind.UNKNOWN else logging.INFO
        message = (
            "engine not reached; kind pending re-detection"
            if info.kind == EngineKind.UNKNOWN
            else "engine detected"
        )
        log_event(
            log,
            level,
            message,
            event="engine_detected",
            kind=info.kind,
            version=info.version,
            mode=info.mode,
            configured=settings.engine,
            upstream=redact_url(settings.upstream_base),
        )
        return info

    async def ensure_detected(self, session: aiohttp.ClientSession) -> EngineInfo:
        """Detect again if start-up detection could not reach the upstream."""
        if self._auto and not self.detected:
            return await self.detect(session)
        return self.info

    async def upstream_came_back(self, session: aiohttp.ClientSession) -> None:
        """The upstream answers again after being down: it may be another engine now, so re-detect (auto)."""
        if self._auto or self.info.version is None:
            await self.detect(session)


ENGINE = web.AppKey("engine", EngineState)


def redetector(app: web.Application) -> Callable[[bool], Awaitable[None]]:
    """What the health watcher calls when the upstream answers (True: back after being down)."""
    engine = app[ENGINE]

    async def redetect(recovered: bool) -> None:
        # Back after being down: it may be another engine now. First contact: detect if
        # start-up detection could not reach it.
        if recovered:
            await engine.upstream_came_back(app[UPSTREAM_POOL])
        else:
            await engine.ensure_detected(app[UPSTREAM_POOL])

    return redetect


def setup_engine_state(app: web.Application) -> None:
    """The engine's identity: detected once the upstream pool is open (needs UPSTREAM_POOL)."""
    engine = EngineState(app[SETTINGS])
    app[ENGINE] = engine

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        await engine.detect(app[UPSTREAM_POOL])
        yield

    app.cleanup_ctx.append(lifetime)
