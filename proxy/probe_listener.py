"""The probe listener (`health_listen`): `/-/healthy` and `/-/ready` on an address of their own.

Client traffic can hold every one of `max_connections` (idle keep-alive connections, a flood);
the kubelet's probes must still be answered, or a busy pod is taken out of its Service and
restarted by its own liveness probe. This listener serves the two probe routes only, from the
main app's health state, with its own connection guard outside `max_connections`.
"""

from __future__ import annotations

from aiohttp import web

from proxy.config import SETTINGS, Settings, parse_listen
from proxy.health import HEALTH, healthy, ready
from proxy.inbound import CONNECTIONS, ConnectionGuard, GuardedSite

__all__ = ["PROBE_CONNECTIONS", "ProbeListener", "build_probe_app"]

# Connections the probe listener holds at once: the kubelet's three probes, with room to spare.
PROBE_CONNECTIONS = 64
# At shutdown: a probe handler answers at once, so nothing needs longer.
_SHUTDOWN_S = 0.5
# A probe carries no body.
_PROBE_BODY_BYTES = 1024


def build_probe_app(main: web.Application) -> web.Application:
    """An app answering the probes from `main`'s health state, and nothing else (404)."""
    settings = main[SETTINGS]
    app = web.Application(client_max_size=_PROBE_BODY_BYTES)
    app[SETTINGS] = settings
    app[HEALTH] = main[HEALTH]
    guard = ConnectionGuard(
        settings.header_timeout,
        settings.body_idle_timeout,
        PROBE_CONNECTIONS,
        client_write_timeout=settings.client_write_timeout,
        body_timeout=settings.body_timeout,
    )
    app[CONNECTIONS] = guard  # in front of every request, by its GuardedSite
    app.router.add_get("/-/healthy", healthy)
    app.router.add_get("/-/ready", ready)
    return app


class ProbeListener:
    """The probe app on `health_listen`: started after the main site, stopped with it."""

    def __init__(self, main: web.Application, settings: Settings) -> None:
        """Listen on `settings.health_listen` (which must be set)."""
        assert settings.health_listen is not None
        app = build_probe_app(main)
        # No handler cancellation is needed: the probe handlers do not wait on anything.
        self._runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            keepalive_timeout=settings.keepalive_timeout,
            shutdown_timeout=_SHUTDOWN_S,
        )
        self._host, self._port = parse_listen(settings.health_listen)

    async def start(self) -> str:
        """Bind and serve; the URL it serves (OSError when the address cannot be bound)."""
        runner = self._runner
        await runner.setup()
        site = GuardedSite(runner, runner.app[CONNECTIONS], self._host, self._port, backlog=128)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        return site.name

    async def stop(self) -> None:
        """Stop serving (the main app's health state is left alone)."""
        await self._runner.cleanup()
