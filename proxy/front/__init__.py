"""The front: plain inference requests served on httptools, without aiohttp's per-request machinery.

At a deployment's paced load a request's cost is the code it runs, once per wake-up (issue
34): aiohttp builds a web.Request, resolves a route and prepares a StreamResponse for every
one. The front frames each request of a connection itself and, for a plain POST the route
policy forwards, runs the same exchange as aiohttp's handler (proxy/forward/engine_exchange.py)
and writes the answer aiohttp would write. Anything else goes to aiohttp with the
connection, from that request's first byte (proxy/front/connection.py).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from proxy.admin.middleware import ROUTE_CLASSES
from proxy.config import SETTINGS
from proxy.connections import CONNECTIONS
from proxy.connections.client import ClientConnection
from proxy.front.connection import FrontConnection
from proxy.front.serve import Front

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
    """Put the front in front of every new client connection (after the routes and the policy are set up)."""
    if not app[SETTINGS].front:
        return
    front = Front(app, app[ROUTE_CLASSES], own_prefixes(app))

    def factory(host: ClientConnection, transport: asyncio.Transport) -> FrontConnection:
        return FrontConnection(front, host, transport)

    app[CONNECTIONS].front = factory
