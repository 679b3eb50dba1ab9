"""Per-case summaries of evidence records (proxy/evidence/summary.py, pure): a case's verdict is its own
once one of its requests ran, `pending` while none did."""

from __future__ import annotations

from typing import Any

from proxy.evidence.summary import summarize

STATE = {
    "event_type": "infer.cache_state",
    "session_id": "s",
    "case_id": "c",
    "reset": {"answer": "acknowledged"},
    "verified": "verified",
}
VERIFICATION = {
    "event_type": "infer.cache_verification",
    "session_id": "s",
    "case_id": "c",
    "verdict": "consistent",
}


def _observation(prompt: int, cached: int) -> dict[str, Any]:
    return {
        "event_type": "infer.cache_observation",
        "session_id": "s",
        "case_id": "c",
        "prompt_tokens": prompt,
        "cached_tokens": cached,
    }


def test_a_case_whose_reset_was_decided_by_another_cases_request_is_pending() -> None:
    (case,) = summarize([STATE, VERIFICATION])
    assert (case.reset_answer, case.verified, case.verdict, case.requests) == (
        "acknowledged",
        "verified",
        "pending",
        0,
    )


def test_a_case_with_one_request_of_its_own_has_the_verdict() -> None:
    (case,) = summarize([STATE, _observation(40, 0), VERIFICATION])
    assert (case.verdict, case.requests, case.prompt_tokens, case.cached_tokens) == ("consistent", 1, 40, 0)
    assert case.hit_ratio == 0.0
