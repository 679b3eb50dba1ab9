"""Client connections: the guard (its limits and counts), one connection, the site that serves them."""

from proxy.connections.client import CLIENT_STALLED, Limit, read_mark
from proxy.connections.guard import CONNECTIONS, PROBE_PATHS, PROBE_SLOTS, ConnectionGuard, setup_connections
from proxy.connections.site import GuardedSite

__all__ = [
    "CLIENT_STALLED",
    "CONNECTIONS",
    "PROBE_PATHS",
    "PROBE_SLOTS",
    "ConnectionGuard",
    "GuardedSite",
    "Limit",
    "read_mark",
    "setup_connections",
]
