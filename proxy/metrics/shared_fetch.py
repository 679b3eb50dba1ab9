"""One fetch shared by every concurrent caller, its result reused for a short while."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

__all__ = ["SharedFetch"]

T = TypeVar("T")


class SharedFetch(Generic[T]):
    """Single-flight with a maximum age: at most one `fetch()` runs at a time.

    Callers that arrive while a fetch runs wait for that one; callers that arrive up
    to `max_age_s` after it finished get its result (a failure, returned as a value by
    `fetch`, is reused the same way, so a slow engine is not asked again by every caller).
    """

    def __init__(self, fetch: Callable[[], Awaitable[T]], max_age_s: float) -> None:
        """Wrap `fetch`; nothing runs until the first `get()`."""
        self._fetch = fetch
        self.max_age_s = max_age_s
        self.fetches_total = 0
        self._result: tuple[float, T] | None = None  # (monotonic time it finished, value)
        self._pending: asyncio.Task[T] | None = None

    async def get(self) -> T:
        """The shared result: reused when fresh, else the running fetch's, else a new fetch's."""
        if self._result is not None and time.monotonic() - self._result[0] <= self.max_age_s:
            return self._result[1]
        if self._pending is None:
            self._pending = asyncio.get_running_loop().create_task(self._run())
        # shield: a caller that leaves (a scraper that disconnected) must not cancel the others' fetch.
        return await asyncio.shield(self._pending)

    async def _run(self) -> T:
        """Run one fetch and keep its result with the time it finished."""
        self.fetches_total += 1
        try:
            value = await self._fetch()
            self._result = (time.monotonic(), value)
            return value
        finally:
            self._pending = None

    async def close(self) -> None:
        """Cancel a fetch still running (at shutdown, before the pool it uses closes)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending
