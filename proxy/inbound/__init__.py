"""Client connections: the guard (its limits and counts), one connection, the site that serves them."""

from proxy.inbound.guard import CONNECTIONS, PROBE_PATHS, PROBE_SLOTS, ConnectionGuard, setup_connections
from proxy.inbound.limits import CLIENT_STALLED, Limit
from proxy.inbound.site import GuardedSite

__all__ = [
    "CLIENT_STALLED",
    "CONNECTIONS",
    "PROBE_PATHS",
    "PROBE_SLOTS",
    "ConnectionGuard",
    "GuardedSite",
    "Limit",
    "setup_connections",
]
