"""The isolated cases and each one's tally: which requests are isolated, and what they proved.

A case (its `X-Session-Id` and `X-Case-Id`) is isolated by a reset with `isolation: "request"`
or by `POST /cache/cases/{case_id}/isolate`, until the next reset of that case. Every isolated
request, whatever isolated it, is counted under the case it carried; the case's tally ends as
an `infer.cache_isolation` record at the case's close, its idle end or its next reset.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from proxy.isolation.tally import CaseTally, CounterCheck
from proxy.vocabulary import IsolationMode, IsolationResult

__all__ = ["MAX_CASES", "Isolation"]

Key = tuple[str | None, str | None]
# Cases isolated, and tallies open, at once: the oldest ends past it (a client cannot grow
# the sidecar's memory by inventing case ids).
MAX_CASES = 4096
_KEPT_RECORDS = 16


class Isolation:
    """The sidecar's isolation state: its config mode, the isolated cases, the open tallies."""

    def __init__(
        self,
        mode: IsolationMode,
        *,
        idle_s: float,
        write: Callable[[dict[str, Any]], None],
        count: Callable[[IsolationResult], None],
    ) -> None:
        """`write` takes each `infer.cache_isolation` record, `count` each request's result (the metric)."""
        self.mode = mode
        self._idle_s = idle_s
        self._write = write
        self._count = count
        self._cases: OrderedDict[Key, None] = OrderedDict()
        self._tallies: OrderedDict[Key, CaseTally] = OrderedDict()
        self._recent: deque[dict[str, Any]] = deque(maxlen=_KEPT_RECORDS)
        self.written = 0  # records written so far (a mark for `written_since`)
        self._open = asyncio.Event()  # set while a tally is open: the idle watcher sleeps on it

    # -- which requests ------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether any request without the header may be isolated (config, or an isolated case)."""
        return self.mode == IsolationMode.REQUEST or bool(self._cases)

    def wanted(self, asked: bool, session_id: str | None, case_id: str | None) -> bool:
        """Whether a request is isolated: its header (`asked`), the config, or its case."""
        if asked or self.mode == IsolationMode.REQUEST:
            return True
        cases = self._cases
        return (
            bool(cases)
            and case_id is not None
            and ((session_id, case_id) in cases or (None, case_id) in cases)
        )

    def isolate(self, session_id: str | None, case_id: str) -> None:
        """Isolate every request of this case (of any session when `session_id` is None) until its next reset."""
        key = (session_id, case_id)
        self._cases[key] = None
        self._cases.move_to_end(key)
        while len(self._cases) > MAX_CASES:
            self._cases.popitem(last=False)

    def reset(self, session_id: str | None, case_id: str | None, mode: IsolationMode) -> None:
        """A reset of this case: its tally ends, and its isolation is what the reset asked for."""
        self._end(lambda key: key == (session_id, case_id), "reset", None)
        self._cases.pop((session_id, case_id), None)
        if mode == IsolationMode.REQUEST and case_id is not None:
            self.isolate(session_id, case_id)

    # -- what they proved ----------------------------------------------------------------------
    def counted(self, session_id: str | None, case_id: str | None, result: IsolationResult) -> None:
        """One isolated request of this case ended with `result` (refused: it never ran)."""
        key = (session_id, case_id)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = CaseTally(session_id, case_id)
            while len(self._tallies) > MAX_CASES:
                oldest = next(iter(self._tallies))
                self._finish(self._tallies.pop(oldest), "evicted", None)
            self._open.set()
        tally.count(result)
        self._count(result)

    def case_closed(
        self,
        session_id: str | None,
        case_id: str | None,
        closed_by: str,
        counters: tuple[dict[str, int | None] | None, int, int, str],
    ) -> None:
        """The case witness ended a case and read the engine's counters: its tally ends with them.

        `counters`: the engine's deltas, the canary's cached tokens, every request the engine
        served in the case as far as the sidecar knows (bypass included), and the reason.
        """
        tally = self._tallies.get((session_id, case_id))
        if tally is None:
            return
        engine, canary_cached, served, reason = counters
        check = CounterCheck(engine, canary_cached, max(0, served - tally.requests), reason)
        self._end(lambda key: key == (session_id, case_id), closed_by, check)

    def close(self, session_id: str | None, case_id: str) -> list[dict[str, Any]]:
        """`POST /cache/cases/{case_id}/close`: the case's tallies end now (of any session without `session_id`)."""
        return self._end(
            lambda key: key[1] == case_id and (session_id is None or key[0] == session_id), "close", None
        )

    def end_all(self, closed_by: str) -> None:
        """End every open tally (at shutdown, while the evidence writer is still open)."""
        self._end(lambda _key: True, closed_by, None)

    def sweep(self) -> None:
        """End the tallies with no request for `idle_s` (their case is over)."""
        cutoff = time.monotonic() - self._idle_s
        self._end(lambda key: self._tallies[key].last_at <= cutoff, "idle", None)

    async def watch(self) -> None:
        """Sweep while a tally is open; with none, wait without a timer (cancelled at shutdown)."""
        while True:
            await self._open.wait()
            await asyncio.sleep(min(self._idle_s, 1.0))
            self.sweep()
            if not self._tallies:
                self._open.clear()

    def _end(
        self, chosen: Callable[[Key], bool], closed_by: str, counters: CounterCheck | None
    ) -> list[dict[str, Any]]:
        """End the tallies whose key is `chosen`; their records."""
        ended = [key for key in self._tallies if chosen(key)]
        return [self._finish(self._tallies.pop(key), closed_by, counters) for key in ended]

    def _finish(self, tally: CaseTally, closed_by: str, counters: CounterCheck | None) -> dict[str, Any]:
        """Write one tally's record and keep it for `/cache/state`."""
        record = tally.to_record(closed_by, counters)
        self._write(record)
        self._recent.append(record)
        self.written += 1
        return record

    def written_since(self, mark: int, case_id: str) -> list[dict[str, Any]]:
        """The records of `case_id` written since `written` was `mark` (at most the last 16)."""
        fresh = (
            list(self._recent)[-min(self.written - mark, len(self._recent)) :] if self.written > mark else []
        )
        return [record for record in fresh if record["case_id"] == case_id]

    # -- /cache/state --------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The member `isolation` of `/cache/state`."""
        return {
            "mode": self.mode.value,
            "cases": [{"session_id": s, "case_id": c} for s, c in self._cases],
            "open": [tally.summary() for tally in self._tallies.values()],
            "closed": list(self._recent),
        }
