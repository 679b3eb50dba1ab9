"""Per-case summary of evidence records: reset answer, canary result, verdict, requests, tokens, hit ratio."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["CaseSummary", "summarize", "summary_table"]


@dataclass(frozen=True)
class CaseSummary:
    """What the evidence says about one (session, case)."""

    session_id: str | None
    case_id: str | None
    reset_answer: str | None
    verified: str | None
    verdict: str | None
    requests: int
    prompt_tokens: int
    cached_tokens: int
    unknown_cached: int

    @property
    def hit_ratio(self) -> float | None:
        """Cached over prompt tokens of the requests whose cached count is known."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass
class _Tally:
    reset_answer: str | None = None
    verified: str | None = None
    verdict: str | None = None
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    unknown_cached: int = 0


def _reset_word(record: dict[str, Any]) -> str | None:
    """The sidecar's answer for a cache_state record (reference words, else the error's kind)."""
    reset = record.get("reset") or {}
    if reset.get("answer"):
        return str(reset["answer"])
    error = reset.get("error") or ""
    return error.split(":", 1)[0] or None


def _case_verdict(tally: _Tally) -> str | None:
    """The traffic verdict as the case's own: `pending` while none of its requests ran.

    A reset's verdict is decided by the first request after it, whoever sent it: a case that
    sent none (a reset the next case's traffic followed) has not shown anything itself.
    """
    if tally.reset_answer is not None and tally.requests == 0 and tally.verdict is not None:
        return "pending"
    return tally.verdict


def summarize(records: Iterable[dict[str, Any]]) -> list[CaseSummary]:
    """Group records by (session_id, case_id), in the order cases first appear."""
    tallies: dict[tuple[str | None, str | None], _Tally] = {}
    for record in records:
        key = (record.get("session_id"), record.get("case_id"))
        tally = tallies.setdefault(key, _Tally())
        kind = record.get("event_type")
        if kind == "infer.cache_state":
            tally.reset_answer = _reset_word(record)
            tally.verified = record.get("verified")
            tally.verdict = tally.verdict or "pending"
        elif kind == "infer.cache_verification":
            tally.verdict = record.get("verdict")
        elif kind == "infer.cache_observation":
            tally.requests += 1
            cached = record.get("cached_tokens")
            prompt = record.get("prompt_tokens")
            if cached is None:
                tally.unknown_cached += 1
            elif isinstance(prompt, int):
                tally.cached_tokens += cached
                tally.prompt_tokens += prompt
    return [
        CaseSummary(
            session,
            case,
            t.reset_answer,
            t.verified,
            _case_verdict(t),
            t.requests,
            t.prompt_tokens,
            t.cached_tokens,
            t.unknown_cached,
        )
        for (session, case), t in tallies.items()
    ]


def summary_table(cases: list[CaseSummary]) -> str:
    """A fixed-width text table, one row a case."""
    header = (
        "session",
        "case",
        "reset",
        "verified",
        "verdict",
        "requests",
        "prompt_tok",
        "cached_tok",
        "hit_ratio",
    )
    rows = [header]
    for case in cases:
        ratio = f"{case.hit_ratio:.1%}" if case.hit_ratio is not None else "n/a"
        rows.append(
            (
                case.session_id or "-",
                case.case_id or "-",
                case.reset_answer or "-",
                case.verified or "-",
                case.verdict or "-",
                str(case.requests),
                str(case.prompt_tokens),
                str(case.cached_tokens),
                ratio,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )
