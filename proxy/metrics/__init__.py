"""Prometheus metrics on a private registry, and `GET /metrics` merged with the engine's own.

The sidecar's families all start with `cachewitness_` and live on their own
`CollectorRegistry`: the engine's exposition already carries `process_*`/`python_*`
families, and a second copy in the merged text would collide. The merge itself is
istio-agent's: the sidecar's text, then the engine's text, fetched on demand.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp
from aiohttp import web
from prometheus_client import disable_created_metrics

from proxy.config import SETTINGS
from proxy.engines.counters import metrics_path
from proxy.engines.queries import fetch_engine_metrics, fetch_model_ids
from proxy.metrics.families import Metrics
from proxy.metrics.labels import (
    CODES,
    CONTENT_TYPE,
    ENGINE_LABELS,
    OTHER,
    ROUTES,
    UPSTREAM_ERROR_KINDS,
    VERDICTS,
)
from proxy.metrics.merge import engine_exposition
from proxy.metrics.models import MODELS_RETRY_S, ModelLabels
from proxy.metrics.per_model import ROUTER_METRICS_QUERY, merge_per_model
from proxy.metrics.shared_fetch import SharedFetch
from proxy.metrics.state import SidecarState, StateCollector
from proxy.upstream.pools import UPSTREAM_POOL

__all__ = [
    "CODES",
    "CONTENT_TYPE",
    "ENGINE_LABELS",
    "ENGINE_METRICS_MAX_AGE_S",
    "ENGINE_TEXT",
    "METRICS",
    "OTHER",
    "ROUTES",
    "UPSTREAM_ERROR_KINDS",
    "VERDICTS",
    "Metrics",
    "ModelLabels",
    "SidecarState",
    "engine_exposition",
    "handle_metrics",
    "setup_metrics",
]

# Concurrent scrapes share one engine fetch, and its text serves scrapes for this long after it
# (several Prometheus replicas and dashboards must not multiply the engine's /metrics work).
ENGINE_METRICS_MAX_AGE_S = 1.0
ENGINE_TEXT = web.AppKey("engine_text", SharedFetch)
METRICS = web.AppKey("metrics", Metrics)


@dataclass(frozen=True)
class _Readers:
    """What metrics reads of the services above it, handed by build_app."""

    state: Callable[[], SidecarState]
    engine_kind: Callable[[], str]


_READERS = web.AppKey("metrics_readers", _Readers)


async def refresh_models(app: web.Application) -> None:
    """Learn the engine's model ids (when no allow-list is configured). Never raises."""
    metrics = app[METRICS]
    session = app[UPSTREAM_POOL]
    if metrics.models.configured or session.closed:
        return
    settings = app[SETTINGS]
    metrics.models.tried_at = time.monotonic()
    listed = await fetch_model_ids(
        session, settings.upstream_base, settings.upstream_metrics_timeout, settings.engine_key
    )
    if listed is not None:
        metrics.learn_models(listed)


async def handle_metrics(request: web.Request) -> web.Response:
    """GET /metrics: the sidecar's exposition, then the engine's own when it has one."""
    app = request.app
    metrics = app[METRICS]
    metrics.show_engine(app[_READERS].engine_kind())
    session = app[UPSTREAM_POOL]
    engine_text: bytes | None = None
    if not session.closed:
        fetch = app[ENGINE_TEXT].get()
        if metrics.models.due(time.monotonic(), retry_s=0.0):
            engine_text, _ = await asyncio.gather(fetch, refresh_models(app))
        else:
            engine_text = await fetch
    body = metrics.exposition(engine_metrics_up=engine_text is not None) + (engine_text or b"")
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


# llama.cpp's router (proxy/engines/modes.py EngineMode.ROUTER): its /metrics wants ?model=.
ROUTER_MODE = "router"
_MOST_ROUTER_MODELS = 16


async def _router_text(session: aiohttp.ClientSession, base: str, timeout_s: float) -> bytes | None:
    """Each loaded model's `/metrics` (never loading one), merged with a `model` label."""
    models = (await fetch_model_ids(session, base, timeout_s) or [])[:_MOST_ROUTER_MODELS]
    texts = await asyncio.gather(
        *(
            fetch_engine_metrics(session, base, timeout_s, ROUTER_METRICS_QUERY + quote(m, safe=""))
            for m in models
        )
    )
    found = [(model, text) for model, text in zip(models, texts, strict=True) if text is not None]
    return engine_exposition(merge_per_model(found)) if found else None


def setup_metrics(
    app: web.Application,
    *,
    state: Callable[[], SidecarState],
    engine_kind: Callable[[], str],
    engine_mode: Callable[[], str | None] = lambda: None,
) -> Metrics:
    """Create the app's Metrics and learn the engine's model ids at start (`GET /metrics` is in the routes).

    `state` reads the services' gauges and counters at each scrape, `engine_kind` the kind of
    the engine fronted now: metrics stands below those services and imports none of them.
    """
    # `*_created` series double every counter and histogram for nothing a dashboard uses
    # (vLLM turns them off the same way); process-wide, and the sidecar owns its process.
    disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
    metrics = Metrics(app[SETTINGS])
    metrics.registry.register(StateCollector(state))
    app[METRICS] = metrics
    app[_READERS] = _Readers(state, engine_kind)

    async def fetch_engine_text() -> bytes | None:
        """The engine's /metrics through the app's upstream pool (None while it is closed)."""
        session, settings = app[UPSTREAM_POOL], app[SETTINGS]
        if session.closed:
            return None
        if engine_mode() == ROUTER_MODE:
            return await _router_text(session, settings.upstream_base, settings.upstream_metrics_timeout)
        text = await fetch_engine_metrics(
            session, settings.upstream_base, settings.upstream_metrics_timeout, metrics_path(engine_kind())
        )
        return engine_exposition(text) if text is not None else None

    shared_text: SharedFetch[bytes | None] = SharedFetch(fetch_engine_text, ENGINE_METRICS_MAX_AGE_S)
    app[ENGINE_TEXT] = shared_text
    pending: set[asyncio.Task[None]] = set()
    stopping: list[bool] = []

    def on_unknown_models() -> None:
        """From the hot path: fetch the model ids in the background, one fetch at a time, throttled."""
        if pending or stopping or not metrics.models.due(time.monotonic(), MODELS_RETRY_S):
            return
        metrics.models.tried_at = time.monotonic()
        task = asyncio.get_running_loop().create_task(refresh_models(app))
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        """Learn the model ids once the pool is open; at shutdown, cancel background fetches
        before the pool closes, and start none after."""
        await refresh_models(app)
        yield
        stopping.append(True)
        await shared_text.close()
        for task in list(pending):
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    metrics.on_unknown_models = on_unknown_models
    app.cleanup_ctx.append(lifetime)
    return metrics
