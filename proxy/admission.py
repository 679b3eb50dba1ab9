"""In-flight request counting and the drain gate shared by forwarding and resets."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from aiohttp import web

__all__ = ["ADMISSION", "Admission", "DrainResult", "Hold", "setup_admission"]


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


@dataclass(eq=False)
class Hold:
    """One holder's claim on the gate (a reset round): its own deadline for the requests it holds."""

    deadline: float  # monotonic time after which a request held by this hold gives up


@dataclass(eq=False)
class _Ticket:
    """A request waiting at the closed gate; `admitted` resolves True when the gate lets it in."""

    deadline: float
    admitted: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    """Counts forwarded requests in flight and holds new ones while a reset drains.

    Forwarding calls `admit()` before it contacts the upstream and `leave()` when the
    exchange is over. A reset calls `hold(budget)`, then `wait_idle()`, does its work,
    and `release(hold)`s the gate. Opening the gate admits every waiting request at
    once, counted in flight before any of them runs: a reset that closes the gate
    again right after (a coalesced round) drains them too, instead of meeting them
    at the engine. A held request waits at most the budget of the holds it met.
    """

    def __init__(self) -> None:
        self._inflight = 0
        self._holds: list[Hold] = []
        self._waiting: list[_Ticket] = []
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def inflight(self) -> int:
        """Requests admitted and not yet finished."""
        return self._inflight

    @property
    def held(self) -> int:
        """Requests waiting at the gate right now."""
        return len(self._waiting)

    @property
    def draining(self) -> bool:
        """True while a reset holds the gate."""
        return bool(self._holds)

    async def admit(self) -> bool:
        """Enter, waiting while the gate is held; False when the holds' budget ran out."""
        if not self._holds:
            self._enter()
            return True
        ticket = _Ticket(deadline=max(hold.deadline for hold in self._holds))
        self._waiting.append(ticket)
        try:
            timeout = max(0.0, ticket.deadline - time.monotonic())
            return await asyncio.wait_for(asyncio.shield(ticket.admitted), timeout=timeout)
        except TimeoutError:
            # The gate may have opened in the same turn the wait ran out: then we are in.
            return ticket.admitted.done() and ticket.admitted.result()
        except asyncio.CancelledError:
            if ticket.admitted.done() and ticket.admitted.result():
                self.leave()  # admitted, then the client left before its exchange began
            raise
        finally:
            if not ticket.admitted.done():
                ticket.admitted.set_result(False)
            if ticket in self._waiting:
                self._waiting.remove(ticket)

    def _enter(self) -> None:
        """Count one request in flight."""
        self._inflight += 1
        if self._inflight == 1:  # set only at 0: cleared once, not per request (a call)
            self._idle.clear()

    def leave(self) -> None:
        """A request admitted by `admit()` has finished."""
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    def hold(self, budget_s: float) -> Hold:
        """Close the gate: new requests wait in `admit()`, for at most `budget_s` from now."""
        hold = Hold(deadline=time.monotonic() + budget_s)
        self._holds.append(hold)
        return hold

    def release(self, hold: Hold) -> None:
        """Drop `hold`; once no hold is left, admit every waiting request at once."""
        if hold in self._holds:
            self._holds.remove(hold)
        if self._holds:
            return
        waiting, self._waiting = self._waiting, []
        for ticket in waiting:
            if not ticket.admitted.done():
                # Counted now, not when the request's task next runs: see the class docstring.
                self._enter()
                ticket.admitted.set_result(True)

    async def wait_idle(self, timeout_s: float) -> DrainResult:
        """Wait until nothing is in flight, at most `timeout_s`."""
        start = time.monotonic()
        at_start = self._inflight
        if at_start:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
        return DrainResult(
            waited_s=time.monotonic() - start,
            inflight_at_start=at_start,
            inflight_at_end=self._inflight,
            held=self.held,
        )


ADMISSION = web.AppKey("admission", Admission)


def setup_admission(app: web.Application) -> None:
    """The gate every forwarded request passes (no lifetime: it holds no resource)."""
    app[ADMISSION] = Admission()
