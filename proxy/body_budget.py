"""The budget of bytes held in memory for requests in flight (`max_buffered_bytes`).

An inference request is read whole to be observed. Without a bound, a few concurrent
63 MiB prompts take the sidecar past its container's memory limit; with one, a request
whose body would pass the budget is forwarded streaming, unobserved, and counted. What the
relay holds for a client that reads its answer slowly counts too (proxy/forward/relay.py).

A body takes the budget as its bytes arrive, never for bytes only declared: a client that
declares 64 MiB and trickles holds what it sent (issue 27, M4: four such uploads used to
reserve all 256 MiB before a byte came, and every other request went unobserved). When
bodies arriving together outgrow the budget, the youngest reader gives up (its start goes to
the engine, the rest streams) so the older ones finish: which bodies are observed does not
depend on how their bytes interleave.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from proxy.config import SETTINGS
from proxy.logs import LogThrottle, log_event

__all__ = ["BODY_BUDGET", "BodyBudget", "Reading", "setup_body_budget"]

log = logging.getLogger("cachewitness.forward")

# How long a reader waits for the readers it made give up to hand their bytes to the engine.
_WAIT_S = 10.0


class Reading:
    """One body being read into the budget: what it holds, and whether an older reader needs its share."""

    __slots__ = ("evicted", "held")

    def __init__(self) -> None:
        self.held = 0
        self.evicted = False


class BodyBudget:
    """Bytes held now, within `limit`; requests that did not fit, counted."""

    def __init__(self, limit: int) -> None:
        """A budget of `limit` bytes (0: nothing is buffered, every request streams unobserved)."""
        self.limit = limit
        self.held = 0
        self.unobserved_total = 0
        self._throttle = LogThrottle()
        self._readers: dict[Reading, None] = {}  # in the order they started
        self._returning: set[Reading] = set()  # gave up: their bytes are on their way to the engine
        self._freed: asyncio.Event | None = None  # set when budget comes back while a reader waits

    def fits(self, size: int) -> bool:
        """Whether `size` more bytes would fit now (nothing is taken)."""
        return self.held + size <= self.limit

    def start_reading(self) -> Reading:
        """A body starts arriving; `done_reading` when it is all in or given up."""
        reading = Reading()
        self._readers[reading] = None
        return reading

    def done_reading(self, reading: Reading, *, complete: bool) -> None:
        """The body is all in, or given up; what it holds stays held until `give_back`."""
        self._readers.pop(reading, None)
        if not complete and reading.held:
            self._returning.add(reading)
        if self._freed is not None:  # a reader waits (rarely: a call saved per request otherwise)
            self._wake()

    def give_back(self, reading: Reading) -> None:
        """Give back what `reading` holds (its body went to the engine, or the exchange is over)."""
        self._returning.discard(reading)
        self.release(reading.held)
        reading.held = 0

    async def take(self, reading: Reading, size: int) -> bool:
        """Take `size` bytes that arrived for `reading`; False when it must give up instead.

        Short of budget, the youngest reader that started after this one and holds bytes is
        told to give up, and this one waits (bounded) for those bytes to reach the engine.
        """
        deadline: float | None = None
        while not reading.evicted:
            if self.held + size <= self.limit:
                self.held += size
                reading.held += size
                return True
            # Bytes of readers already told to give up come back once the engine has them.
            coming_back = sum(r.held for r in self._returning) + sum(
                r.held for r in self._readers if r.evicted
            )
            if self.held - coming_back + size > self.limit:
                younger = self._youngest_after(reading)
                if younger is not None:
                    younger.evicted = True
                    continue
            if not coming_back:
                return False  # nothing will come back soon
            loop = asyncio.get_running_loop()
            deadline = deadline if deadline is not None else loop.time() + _WAIT_S
            if not await self._wait_freed(deadline - loop.time()):
                return False
        return False

    def take_now(self, reading: Reading, size: int) -> bool:
        """Take `size` bytes that arrived for `reading` if they fit now; False (nothing taken) if not.

        For a reader that cannot wait (the front, proxy/inbound/connection.py): it hands the
        request to a reader that can instead, which then takes the budget its own way.
        """
        if reading.evicted or self.held + size > self.limit:
            return False
        self.held += size
        reading.held += size
        return True

    def hold(self, size: int) -> None:
        """Count `size` bytes already in memory (they are held whether or not they fit)."""
        self.held += size

    def release(self, size: int) -> None:
        """Give back bytes counted by `hold`."""
        if size:
            self.held -= size
            if self._freed is not None:
                self._wake()

    def _youngest_after(self, reading: Reading) -> Reading | None:
        for other in reversed(self._readers):
            if other is reading:
                return None
            if other.held and not other.evicted:
                return other
        return None

    async def _wait_freed(self, timeout_s: float) -> bool:
        """Wait until some budget comes back or a reader stops; False when `timeout_s` passed first."""
        if timeout_s <= 0:
            return False
        if self._freed is None:
            self._freed = asyncio.Event()
        try:
            await asyncio.wait_for(self._freed.wait(), timeout=timeout_s)
        except TimeoutError:
            return False
        return True

    def _wake(self) -> None:
        freed, self._freed = self._freed, None
        if freed is not None:
            freed.set()

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
