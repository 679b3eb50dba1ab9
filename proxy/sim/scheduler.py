"""Running places of the simulated engine under --max-concurrency, and who of the waiting runs next."""

from __future__ import annotations

import asyncio
import heapq
import itertools

__all__ = ["Scheduler"]


class Scheduler:
    """At most `limit` requests run; the waiting ones start first come, first served — or, with
    `by_priority`, lowest `priority` first (vLLM's `--scheduling-policy priority`), so a later
    request can run before an earlier one."""

    def __init__(self, limit: int, *, by_priority: bool) -> None:
        """`limit` running places (> 0)."""
        self._free = limit
        self._by_priority = by_priority
        self._arrivals = itertools.count()
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []

    @property
    def waiting(self) -> int:
        """Requests waiting for a place."""
        return sum(1 for *_, future in self._waiting if not future.done())

    def try_enter(self) -> bool:
        """Take a free place at once when nobody waits for one."""
        if self._free > 0 and not self.waiting:
            self._free -= 1
            return True
        return False

    async def enter(self, priority: int) -> None:
        """Take a place, waiting for one (in policy order) while none is free."""
        if self.try_enter():
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        key = priority if self._by_priority else 0
        heapq.heappush(self._waiting, (key, next(self._arrivals), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.leave()  # the place was handed over as the waiter left: pass it on
            raise

    def leave(self) -> None:
        """Give a place back: to the next waiter in policy order, else to the free pool."""
        while self._waiting:
            *_, future = heapq.heappop(self._waiting)
            if not future.done():
                future.set_result(None)
                return
        self._free += 1
