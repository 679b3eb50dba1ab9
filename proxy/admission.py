"""In-flight request counting and the drain gate shared by forwarding and resets."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

__all__ = ["Admission", "DrainResult"]


@dataclass(frozen=True)
class DrainResult:
    """What a drain saw: how long it waited and what was running or held."""

    waited_s: float
    inflight_at_start: int
    inflight_at_end: int
    held: int

    def to_json(self) -> dict[str, float | int]:
        """The `drain` block of a reset answer."""
        return {
            "waited_s": round(self.waited_s, 6),
            "inflight_at_start": self.inflight_at_start,
            "held": self.held,
        }


class Admission:
    """Counts forwarded requests in flight and holds new ones while a reset drains.

    Forwarding calls `admit()` before it contacts the upstream and `leave()` when
    the exchange is over. A reset calls `hold(budget)`, then `wait_idle()`, does its
    work, and `release()`s the gate so held requests go on. A held request waits
    at most the budget of the hold it met (the reset's worst case), then gives up.
    """

    def __init__(self) -> None:
        self._inflight = 0
        self._held = 0
        self._holds = 0
        self._budget_s = 0.0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def inflight(self) -> int:
        """Requests admitted and not yet finished."""
        return self._inflight

    @property
    def held(self) -> int:
        """Requests waiting at the gate right now."""
        return self._held

    @property
    def draining(self) -> bool:
        """True while a reset holds the gate."""
        return self._holds > 0

    async def admit(self) -> bool:
        """Enter, waiting while the gate is held; False when the hold's budget ran out."""
        if not self._open.is_set():
            self._held += 1
            try:
                await asyncio.wait_for(self._open.wait(), timeout=self._budget_s)
            except TimeoutError:
                return False
            finally:
                self._held -= 1
        self._inflight += 1
        self._idle.clear()
        return True

    def leave(self) -> None:
        """A request admitted by `admit()` has finished."""
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    def hold(self, budget_s: float) -> None:
        """Close the gate: new requests wait in `admit()`, each for at most `budget_s`."""
        self._holds += 1
        self._budget_s = budget_s
        self._open.clear()

    def release(self) -> None:
        """Open the gate again once every holder released it."""
        self._holds = max(0, self._holds - 1)
        if self._holds == 0:
            self._open.set()

    async def wait_idle(self, timeout_s: float) -> DrainResult:
        """Wait until nothing is in flight, at most `timeout_s`."""
        start = time.monotonic()
        at_start = self._inflight
        if at_start:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
            except TimeoutError:
                pass
        return DrainResult(
            waited_s=time.monotonic() - start,
            inflight_at_start=at_start,
            inflight_at_end=self._inflight,
            held=self._held,
        )
