"""The isolated cases and their tallies (proxy/isolation/cases.py), without I/O."""

from __future__ import annotations

from typing import Any

from proxy.isolation import Isolation
from proxy.isolation.cases import MAX_CASES
from proxy.vocabulary import IsolationMode, IsolationResult


def _isolation() -> tuple[Isolation, list[dict[str, Any]]]:
    written: list[dict[str, Any]] = []
    return Isolation(IsolationMode.NONE, idle_s=30.0, write=written.append, count=lambda _r: None), written


def test_too_many_open_tallies_end_the_oldest_as_its_record() -> None:
    isolation, written = _isolation()
    for index in range(MAX_CASES + 1):
        isolation.counted("s", f"case-{index}", IsolationResult.COLD)
    assert [(r["case_id"], r["closed_by"], r["requests"]) for r in written] == [("case-0", "evicted", 1)]
    assert len(isolation.state()["open"]) == MAX_CASES


def test_too_many_isolated_cases_forget_the_oldest() -> None:
    isolation, _ = _isolation()
    for index in range(MAX_CASES + 1):
        isolation.isolate(None, f"case-{index}")
    assert not isolation.wanted(False, "s", "case-0")
    assert isolation.wanted(False, "s", f"case-{MAX_CASES}")
    assert len(isolation.state()["cases"]) == MAX_CASES


def test_a_case_isolated_for_one_session_is_not_anothers() -> None:
    isolation, _ = _isolation()
    isolation.isolate("s1", "c")
    assert isolation.wanted(False, "s1", "c")
    assert not isolation.wanted(False, "s2", "c")
    assert not isolation.wanted(False, "s1", None)
