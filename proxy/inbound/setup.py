"""The front's place on every client connection, set up once the routes and the route policy are."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from proxy.config import SETTINGS
from proxy.forward.services import SERVICES
from proxy.inbound.front import Front
from proxy.inbound.guard import CONNECTIONS

__all__ = ["own_prefixes", "setup_front"]


def own_prefixes(app: web.Application) -> tuple[str, ...]:
    """The start of each route the sidecar answers itself (up to its first variable): never the front's."""
    prefixes = []
    for resource in app.router.resources():
        prefix = resource.canonical.partition("{")[0]
        if prefix != "/":  # the catch-all `/{tail:.*}` is forwarding's
            prefixes.append(prefix)
    return tuple(prefixes)


def setup_front(app: web.Application) -> None:
    """With `front = true` (the default): the front serves beside aiohttp on every new client
    connection; with false, aiohttp serves every request."""
    guard = app[CONNECTIONS]
    if app[SETTINGS].front:
        front = guard.front = Front(app, own_prefixes(app), guard)

        async def lifetime(app: web.Application) -> AsyncIterator[None]:
            front.services = app[SERVICES]  # gathered by forwarding's lifetime, which starts before
            yield

        app.cleanup_ctx.append(lifetime)
