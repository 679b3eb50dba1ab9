"""Requests the route policy turns away (admin auth, unsafe paths): counted by reason, logged throttled.

One log line per refused request let a client that loops on a refused route write the log
as fast as it can send (issue 27): like the connection limits (proxy/inbound/), each
reason logs at most one line per 10 s, carrying how many requests it stands for, and the
metric `cachewitness_route_refusals_total{reason}` counts every one.
"""

from __future__ import annotations

import logging
from enum import StrEnum

from aiohttp import web

from proxy.logs import LogThrottle, log_event

__all__ = ["REFUSALS", "RefusalReason", "Refusals"]

log = logging.getLogger("cachewitness.auth")


class RefusalReason(StrEnum):
    """Why the route policy refused a request: the error code its answer carries."""

    INVALID_REQUEST_TARGET = "invalid_request_target"  # 400: engines could read the path differently
    MISSING_ADMIN_TOKEN = "missing_admin_token"  # 401
    INVALID_ADMIN_TOKEN = "invalid_admin_token"  # 401
    ADMIN_LOOPBACK_ONLY = "admin_loopback_only"  # 403: no token set and the peer is not trusted


class Refusals:
    """Counts refused requests per reason and logs them, one line per reason per `every_s`."""

    def __init__(self, every_s: float = 10.0) -> None:
        """Start from zero."""
        self.counts: dict[RefusalReason, int] = dict.fromkeys(RefusalReason, 0)
        self._throttle = LogThrottle(every_s)

    def refused(
        self, reason: RefusalReason, *, method: str, path: str, status: int, peer: str | None
    ) -> None:
        """Count one refusal; log it when a line for its reason is due (with the count since the last)."""
        self.counts[reason] += 1
        refused = self._throttle.due(reason)
        if refused:
            # The path is cut (it may be 8 KB); a line stands for `refused` requests, this one the latest.
            log_event(
                log,
                logging.WARNING,
                "request refused by the route policy",
                event="route_refused",
                reason=str(reason),
                refused=refused,
                method=method,
                path=path[:200],
                status=status,
                peer=peer,
            )


REFUSALS = web.AppKey("refusals", Refusals)
