"""The budget of request-body bytes held in memory, across every observed request (`max_buffered_bytes`).

An inference request is read whole to be observed. Without a bound, a few concurrent
63 MiB prompts take the sidecar past its container's memory limit; with one, a request
whose body would pass the budget is forwarded streaming, unobserved, and counted.
"""

from __future__ import annotations

import logging

from aiohttp import web

from proxy.config import SETTINGS
from proxy.logs import LogThrottle, log_event

__all__ = ["BODY_BUDGET", "BodyBudget", "setup_body_budget"]

log = logging.getLogger("cachewitness.forward")


class BodyBudget:
    """Bytes of request bodies held now, within `limit`; requests that did not fit, counted."""

    def __init__(self, limit: int) -> None:
        """A budget of `limit` bytes (0: nothing is buffered, every request streams unobserved)."""
        self.limit = limit
        self.held = 0
        self.unobserved_total = 0
        self._throttle = LogThrottle()

    def reserve(self, size: int) -> bool:
        """Take `size` bytes of the budget if they fit; whether they did."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def release(self, size: int) -> None:
        """Give back bytes taken by `reserve`."""
        self.held -= size

    def passed_unobserved(self, request_id: str, size: int | None) -> None:
        """Count a request forwarded unobserved because its body did not fit; log it (throttled)."""
        self.unobserved_total += 1
        if count := self._throttle.due("max_buffered_bytes"):
            log_event(
                log,
                logging.WARNING,
                "request body past max_buffered_bytes: forwarded streaming, unobserved",
                request_id=request_id,
                body_bytes=size,
                buffered_bytes=self.held,
                max_buffered_bytes=self.limit,
                requests=count,
            )


BODY_BUDGET = web.AppKey("body_budget", BodyBudget)


def setup_body_budget(app: web.Application) -> BodyBudget:
    """The app's one budget (no lifetime: it holds counts, not memory)."""
    budget = BodyBudget(app[SETTINGS].max_buffered_bytes)
    app[BODY_BUDGET] = budget
    return budget
