"""What `cachewitness report` shows, read from one session's evidence records (docs/evidence.md).

The case table is the per-case summary `cachewitness evidence --summary` prints, plus the
witnesses that ran on each case's reset and the traffic that bypassed the sidecar where the
engine's counters said; the plots are the session's requests and resets on one time axis.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from proxy.evidence.summary import summarize

__all__ = ["CaseRow", "Heat", "ReportData", "RequestPoint", "ResetMark", "build_report"]


class Heat(StrEnum):
    """How a request found the prefix cache, by the cached tokens it reported."""

    COLD = "cold"  # 0 cached tokens
    WARM = "warm"  # some cached tokens
    UNKNOWN = "unknown"  # the engine did not say


@dataclass(frozen=True)
class CaseRow:
    """One row of the case table, as printed (every cell a string)."""

    case_id: str
    reset: str
    verified: str
    verdict: str
    witnesses: str
    requests: str
    prompt_tokens: str
    cached_tokens: str
    hit_ratio: str
    bypass: str
    first_byte: str  # the case's requests' median time to first byte
    added: str  # the time the sidecar itself added to them, p50 / p99

    def cells(self) -> tuple[str, ...]:
        """The cells in column order (COLUMNS)."""
        return (
            self.case_id,
            self.reset,
            self.verified,
            self.verdict,
            self.witnesses,
            self.requests,
            self.prompt_tokens,
            self.cached_tokens,
            self.hit_ratio,
            self.bypass,
            self.first_byte,
            self.added,
        )


COLUMNS = (
    "case",
    "engine answer",
    "verified",
    "verdict",
    "witnesses",
    "requests",
    "prompt tokens",
    "cached tokens",
    "hit ratio",
    "bypass",
    "first byte p50",
    "sidecar added p50 / p99",
)


@dataclass(frozen=True)
class RequestPoint:
    """One observed request: when it started, what it reported, how long its first byte took."""

    started_ns: int
    case_id: str | None
    cached_tokens: int | None
    prompt_tokens: int | None
    ttft_ms: float | None  # first byte to the client minus start; None when none was sent
    heat: Heat
    # An isolated request's result (cold, contradicted, unobservable, refused); None: not isolated.
    isolation: str | None = None
    # The time the sidecar itself added (the record's overhead, in and out); None when unmeasured.
    added_us: int | None = None

    def css(self, base: str) -> str:
        """Its CSS classes on a plot: `base`, and `isolated` (`isolated contradicted`) when isolated."""
        if self.isolation is None:
            return base
        return f"{base} isolated" + (" contradicted" if self.isolation == "contradicted" else "")

    @property
    def words(self) -> str:
        """What its title says of its isolation ('' when not isolated)."""
        return f", isolated: {self.isolation}" if self.isolation is not None else ""


@dataclass(frozen=True)
class ResetMark:
    """One reset (an `infer.cache_state` record) on the time axis."""

    at_ns: int
    case_id: str | None
    verified: str


@dataclass(frozen=True)
class ReportData:
    """Everything the page shows for one session."""

    session_id: str
    cases: tuple[CaseRow, ...]
    requests: tuple[RequestPoint, ...]
    resets: tuple[ResetMark, ...]

    @property
    def origin_ns(self) -> int:
        """The earliest time on the plots' axis (0 s)."""
        times = [p.started_ns for p in self.requests] + [r.at_ns for r in self.resets]
        return min(times) if times else 0


def _text(value: Any) -> str:
    """A cell's text: '-' for nothing."""
    return "-" if value is None or value == "" else str(value)


def _witnesses(state: Mapping[str, Any] | None) -> str:
    """The witnesses that ran on a reset and what each said (`canary verified, events verified`)."""
    if state is None:
        return "-"
    verification = state.get("verification")
    if not isinstance(verification, dict):
        return "-"  # a record from before witnesses were recorded
    named = verification.get("witnesses")
    if isinstance(named, dict) and named:
        parts = []
        for name, said in named.items():
            result = said.get("result") if isinstance(said, dict) else said
            parts.append(f"{name} {_text(result)}")
        return ", ".join(parts)
    method = verification.get("method")
    if method in (None, "none"):
        return "none"
    return f"{method} {_text(state.get('verified'))}"


def _bypass(reconciliation: Mapping[str, Any] | None) -> str:
    """What reached the engine around the sidecar, where the engine's counters said; '-' unmeasured."""
    if reconciliation is None:
        return "-"
    bypass = reconciliation.get("bypass")
    if not isinstance(bypass, dict):
        return "unknown"
    requests = bypass.get("requests")
    cached = bypass.get("cached_tokens")
    text = f"{_text(requests)} requests"
    return text + (f", {cached} cached tokens" if cached is not None else "")


def _heat(cached: Any) -> Heat:
    if not isinstance(cached, int):
        return Heat.UNKNOWN
    return Heat.COLD if cached == 0 else Heat.WARM


def _point(record: Mapping[str, Any]) -> RequestPoint | None:
    """A plotted request from an `infer.cache_observation` record (None without a start time)."""
    started = record.get("started_ns")
    if not isinstance(started, int):
        return None
    first = record.get("first_byte_ns")
    ttft = (first - started) / 1e6 if isinstance(first, int) else None
    cached = record.get("cached_tokens")
    prompt = record.get("prompt_tokens")
    isolation = record.get("isolation")
    result = isolation.get("result") if isinstance(isolation, dict) else None
    return RequestPoint(
        started_ns=started,
        case_id=record.get("case_id"),
        cached_tokens=cached if isinstance(cached, int) else None,
        prompt_tokens=prompt if isinstance(prompt, int) else None,
        ttft_ms=ttft,
        heat=_heat(cached),
        isolation=result if isinstance(result, str) else None,
        added_us=_added_us(record.get("overhead")),
    )


def _added_us(overhead: Any) -> int | None:
    """A record's `overhead` as one number, in + out (docs/evidence.md); None when it has none."""
    if not isinstance(overhead, dict):
        return None  # a record from before the sidecar measured itself, or a request that reached no engine
    spans = [overhead.get("added_in_us"), overhead.get("added_out_us")]
    measured = [span for span in spans if isinstance(span, int) and not isinstance(span, bool)]
    return sum(measured) if measured else None


def _nearest_rank(values: list[float], q: float) -> float:
    """The smallest value with at least q of `values` at or below it (`values` sorted, not empty)."""
    return values[max(0, math.ceil(round(q * len(values), 6)) - 1)]


def _timing_cells(points: list[RequestPoint]) -> tuple[str, str]:
    """A case's median time to first byte, and the sidecar's added time p50 / p99."""
    ttfts = sorted(p.ttft_ms for p in points if p.ttft_ms is not None)
    added = sorted(float(p.added_us) for p in points if p.added_us is not None)
    first = f"{_nearest_rank(ttfts, 0.5):.1f} ms" if ttfts else "-"
    if not added:
        return first, "-"
    return first, f"{_nearest_rank(added, 0.5):.0f} / {_nearest_rank(added, 0.99):.0f} µs"


def build_report(records: Iterable[Mapping[str, Any]], session_id: str) -> ReportData:
    """The page's data from evidence records; records of other sessions are left out."""
    mine = [dict(r) for r in records if r.get("session_id") == session_id]
    states: dict[str | None, Mapping[str, Any]] = {}
    reconciliations: dict[str | None, Mapping[str, Any]] = {}
    points: list[RequestPoint] = []
    marks: list[ResetMark] = []
    for record in mine:
        kind = record.get("event_type")
        case = record.get("case_id")
        if kind == "infer.cache_state":
            states[case] = record  # the case's last reset is the one its row shows
            at_ns = record.get("at_ns")
            if isinstance(at_ns, int):
                marks.append(ResetMark(at_ns, case, _text(record.get("verified"))))
        elif kind == "infer.cache_reconciliation":
            reconciliations[case] = record
        elif kind == "infer.cache_observation":
            point = _point(record)
            if point is not None:
                points.append(point)
    by_case: dict[str | None, list[RequestPoint]] = {}
    for point in points:
        by_case.setdefault(point.case_id, []).append(point)
    rows = []
    for case in summarize(mine):
        first_byte, added = _timing_cells(by_case.get(case.case_id, []))
        ratio = f"{case.hit_ratio:.1%}" if case.hit_ratio is not None else "n/a"
        rows.append(
            CaseRow(
                case_id=_text(case.case_id),
                reset=_text(case.reset_answer),
                verified=_text(case.verified),
                verdict=_text(case.verdict),
                witnesses=_witnesses(states.get(case.case_id)),
                requests=str(case.requests),
                prompt_tokens=str(case.prompt_tokens),
                cached_tokens=str(case.cached_tokens),
                hit_ratio=ratio,
                bypass=_bypass(reconciliations.get(case.case_id)),
                first_byte=first_byte,
                added=added,
            )
        )
    points.sort(key=lambda p: p.started_ns)
    marks.sort(key=lambda m: m.at_ns)
    return ReportData(session_id, tuple(rows), tuple(points), tuple(marks))
