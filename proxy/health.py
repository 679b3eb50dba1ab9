"""Liveness, readiness, and the background watcher of the upstream's health."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from proxy.config import SETTINGS
from proxy.logs import log_event
from proxy.upstream.pools import UPSTREAM_LEG, UPSTREAM_POOL

__all__ = ["HEALTH", "UpstreamHealth", "healthy", "ready", "setup_health"]

log = logging.getLogger("cachewitness.health")

# Ready means the upstream answered (< 500) within this many probe intervals.
READY_INTERVALS = 3


class UpstreamHealth:
    """Probes the upstream's health path every interval and remembers the last good answer.

    While traffic flows a probe is not needed: an engine that answered a forwarded request
    (below 500, as a probe must) within the last interval is up, and that answer stands in for
    the probe (`answered_at`: when, in loop time, the last one came). A probe costs the idle
    sidecar most of its CPU, and at 100 requests/s several µs per request (issue 34). Only an
    engine known up is vouched for this way: coming up (and the engine's detection that
    follows) is always a probe's to say; going down, too, once answers stop or fail.
    """

    def __init__(
        self,
        base_url: str,
        interval_s: float,
        path: Callable[[], str],
        on_up: Callable[[bool], Awaitable[None]] | None = None,
        answered_at: Callable[[], float | None] | None = None,
    ) -> None:
        self._base = base_url
        self._interval = interval_s
        self._path = path
        self._on_up = on_up
        self._answered_at = answered_at
        self._last_ok: float | None = None
        self._was_up: bool | None = None
        self.shutting_down = False

    @property
    def upstream_up(self) -> bool:
        """The upstream answered its health probe within the last few intervals."""
        return (
            self._last_ok is not None and time.monotonic() - self._last_ok <= READY_INTERVALS * self._interval
        )

    @property
    def ready(self) -> bool:
        """Ready to take traffic: upstream up and not shutting down."""
        return self.upstream_up and not self.shutting_down

    async def probe(self, session: aiohttp.ClientSession) -> bool:
        """One probe; True when the upstream answered below 500."""
        timeout = aiohttp.ClientTimeout(total=max(self._interval, 0.5))
        try:
            async with session.get(
                self._base + self._path(), timeout=timeout, allow_redirects=False
            ) as response:
                await response.read()
                ok = response.status < 500
        except (TimeoutError, aiohttp.ClientError, OSError):
            ok = False
        # Transition first: readiness waits until the engine behind the upstream is known.
        await self._note_transition(ok)
        if ok:
            self._last_ok = time.monotonic()
        return ok

    async def _note_transition(self, ok: bool) -> None:
        """Log up/down changes; when the upstream comes (back) up, let the engine be detected."""
        if ok == self._was_up:
            return
        recovered = ok and self._was_up is False
        self._was_up = ok
        log_event(
            log,
            logging.INFO if ok else logging.WARNING,
            "upstream up" if ok else "upstream down",
            health_path=self._path(),
        )
        if ok and self._on_up is not None:
            await self._on_up(recovered)

    async def watch(self, session: aiohttp.ClientSession) -> None:
        """Probe every interval that traffic did not vouch for, forever (cancelled at shutdown)."""
        loop = asyncio.get_running_loop()
        while True:
            started = time.monotonic()
            if not self._vouched(loop.time()):
                await self.probe(session)
            await asyncio.sleep(max(0.0, self._interval - (time.monotonic() - started)))

    def _vouched(self, now: float) -> bool:
        """Whether an answer to traffic within the last interval shows the engine (known up) up; it
        then counts as the last good answer, at its own time."""
        at = self._answered_at() if self._answered_at is not None else None
        if not self._was_up or at is None or now - at > self._interval:
            return False
        self._last_ok = time.monotonic() - max(0.0, now - at)
        return True


HEALTH = web.AppKey("health", UpstreamHealth)


def setup_health(
    app: web.Application, *, path: Callable[[], str], on_up: Callable[[bool], Awaitable[None]]
) -> None:
    """The upstream health watcher: probes from start (after detection) until shutdown.

    `path` reads the health path of the engine fronted now, `on_up` is told when the upstream
    answers (True: back after being down); build_app hands both from the engine state.
    """
    settings = app[SETTINGS]
    health = UpstreamHealth(
        settings.upstream_base,
        settings.health_interval,
        path=path,
        on_up=on_up,
        answered_at=lambda: app[UPSTREAM_LEG].answered_at,
    )
    app[HEALTH] = health

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        watcher = asyncio.create_task(health.watch(app[UPSTREAM_POOL]))
        yield
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

    app.cleanup_ctx.append(lifetime)


async def healthy(request: web.Request) -> web.Response:
    """Liveness: the process serves."""
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 when the upstream answered recently and we are not shutting down."""
    health = request.app[HEALTH]
    if health.shutting_down:
        return web.json_response({"status": "shutting_down"}, status=503)
    if not health.upstream_up:
        return web.json_response({"status": "upstream_down"}, status=503)
    return web.json_response({"status": "ready"})
