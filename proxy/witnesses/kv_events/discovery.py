"""KV event endpoints the engine names, followed without any kv_events_* setting (`kv_events_discovery`).

Without `kv_events_endpoint`, the sidecar asks the engine where it publishes
(proxy/engines/kv_sources.py) and connects a subscriber to each rank's publisher: at start, and
again whenever a rank has no publisher connected (the engine is not up yet, or restarted, and a
restarted engine may have bound new ports: `tcp://*:0`). Endpoints that did not change are left
alone (ZeroMQ reconnects by itself); changed ones replace every subscriber. A static
`kv_events_endpoint` is an override: no discovery then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from proxy.config import SETTINGS, Settings
from proxy.engines.kv_sources import KvSources, discover_kv_sources
from proxy.logs import log_event
from proxy.upstream.pools import UPSTREAM_POOL
from proxy.witnesses.kv_events.index import CacheIndex, wants_discovery
from proxy.witnesses.kv_events.subscribers import KvEvents, KvEventsConfig

__all__ = ["KV_DISCOVERY", "KvDiscovery", "discovered_config", "run_discovery", "setup_kv_discovery"]

log = logging.getLogger("cachewitness.events")

# How often an engine that named no publisher is asked again.
QUIET_ASK_S = 30.0


def discovered_config(found: KvSources, topic: str) -> KvEventsConfig:
    """The subscribers' configuration for what the engine said: connect to each rank's publisher.

    `topic`: kv_events_topic, for an engine that does not name its topic (SGLang).
    """
    first = found.sources[0]
    return KvEventsConfig(
        first.endpoint,
        first.replay,
        ranks=len(found.sources),
        topic=first.topic if first.topic is not None else topic,
        connect=True,
        rank_endpoints=tuple((source.endpoint, source.replay) for source in found.sources),
        learnt_from=found.learnt_from,
    )


class KvDiscovery:
    """Asks the engine for its publishers and keeps the subscribers on them."""

    def __init__(
        self,
        events: KvEvents,
        settings: Settings,
        session: Callable[[], aiohttp.ClientSession],
        kind: Callable[[], str],
    ) -> None:
        """Follow for `events` what the engine at `settings.upstream_base` says."""
        self._events = events
        self._settings = settings
        self._session = session
        self._kind = kind
        self.found: KvSources | None = None
        self.lookups = 0

    def _stale(self) -> bool:
        """No subscriber yet, or a rank without its publisher: worth asking the engine again."""
        return not self._events.running or not all(snap.connected for snap in self._events.snapshots())

    async def refresh(self) -> bool:
        """Ask the engine; reopen the subscribers when what it says changed. Never raises."""
        settings = self._settings
        self.lookups += 1
        try:
            found = await discover_kv_sources(
                self._session(),
                settings.upstream_base,
                self._kind(),
                settings.reset_attempt_timeout,
                settings.engine_key,
                urlsplit(settings.upstream).hostname or "127.0.0.1",
            )
            if found is None or found == self.found:
                return False
            await self._events.restart_with(discovered_config(found, settings.kv_events_topic))
        except (OSError, ValueError) as exc:
            log_event(log, logging.WARNING, "kv events: discovered endpoints not followed", error=str(exc))
            return False
        self.found = found
        log_event(
            log,
            logging.INFO,
            "kv events: following the engine's publishers",
            event="kv_events_discovered",
            learnt_from=found.learnt_from,
            endpoints=[source.endpoint for source in found.sources],
        )
        return True

    async def watch(self, interval_s: float) -> None:
        """Ask again every interval while a rank has no publisher (cancelled at shutdown).

        An engine that names no publisher (events off, an older vLLM without the route, another
        kind) is asked again only every QUIET_ASK_S: it rarely starts publishing on its own.
        """
        while True:
            if self._stale():
                await self.refresh()
            named = self.found is not None
            await asyncio.sleep(interval_s if named else max(interval_s, QUIET_ASK_S))


def run_discovery(
    discovery: KvDiscovery, interval_s: float
) -> Callable[[web.Application], AsyncIterator[None]]:
    """The lifetime of the discovery watcher: asks at start, stops at shutdown."""

    async def lifetime(_app: web.Application) -> AsyncIterator[None]:
        watcher = asyncio.create_task(discovery.watch(interval_s), name="cachewitness-kv-discovery")
        yield
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

    return lifetime


KV_DISCOVERY = web.AppKey("kv_discovery", KvDiscovery)


def setup_kv_discovery(app: web.Application, index: CacheIndex | None, kind: Callable[[], str]) -> None:
    """With discovery on and no kv_events_endpoint: follow the engine's publishers (`index`: what
    setup_kv_events made, None without it)."""
    settings = app[SETTINGS]
    if index is None or not wants_discovery(settings):
        return
    discovery = KvDiscovery(index.events, settings, lambda: app[UPSTREAM_POOL], kind)
    app[KV_DISCOVERY] = discovery
    app.cleanup_ctx.append(run_discovery(discovery, settings.health_interval))
