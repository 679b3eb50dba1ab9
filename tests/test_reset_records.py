"""The reference client's record rules (stormlog infer.cache_state) for every sidecar outcome."""

from __future__ import annotations

import pytest

from proxy.engines.base import Attempt, CacheReset
from proxy.evidence.records import cache_state_record, run_kind
from proxy.vocabulary import Requested, ResetAnswer


def folded(
    outcome: ResetAnswer, *, status: int | None = 200, error: str | None = None, attempts: int = 1
) -> CacheReset:
    success = {ResetAnswer.ACKNOWLEDGED: True, ResetAnswer.ACCEPTED_UNVERIFIED: None}.get(outcome, False)
    last = Attempt(outcome, status=status, success=success, error=error, url="http://engine/r")
    return CacheReset.from_attempts(last, at_ns=1, attempts=attempts, calls=(), answered_at_ns=2)


@pytest.mark.parametrize(
    ("outcome", "answer", "succeeded", "http_status"),
    [
        (ResetAnswer.ACKNOWLEDGED, "acknowledged", True, 200),
        (ResetAnswer.ACCEPTED_UNVERIFIED, "accepted_unverified", True, 200),
        (ResetAnswer.REFUSED, "refused", False, 409),
        (ResetAnswer.UNSUPPORTED, None, False, 501),
        (ResetAnswer.UNREACHABLE, None, False, 502),
        (ResetAnswer.ERROR, None, False, 502),
    ],
)
def test_answer_words_and_status_by_outcome(
    outcome: ResetAnswer, answer: str | None, succeeded: bool, http_status: int
) -> None:
    reset = folded(outcome)
    assert reset.answer == answer
    assert reset.succeeded is succeeded
    assert reset.http_status == http_status


def test_refusal_error_counts_attempts_like_the_reference() -> None:
    assert (
        folded(ResetAnswer.REFUSED, error="success false", attempts=3).error
        == "refused: success false on 3 attempts"
    )


@pytest.mark.parametrize("outcome", [ResetAnswer.UNSUPPORTED, ResetAnswer.UNREACHABLE, ResetAnswer.ERROR])
def test_failure_error_starts_with_the_outcome(outcome: ResetAnswer) -> None:
    assert folded(outcome, status=None, error="why").error == f"{outcome}: why"


def test_reset_block_has_exactly_the_reference_keys() -> None:
    assert list(folded(ResetAnswer.ACKNOWLEDGED).to_record()) == [
        "url",
        "at_ns",
        "status",
        "error",
        "success",
        "answer",
        "attempts",
        "answered_at_ns",
    ]


@pytest.mark.parametrize(
    ("outcome", "success"),
    [
        (ResetAnswer.ACKNOWLEDGED, True),
        (ResetAnswer.ACCEPTED_UNVERIFIED, None),
        (ResetAnswer.REFUSED, False),
        (ResetAnswer.UNSUPPORTED, None),
        (ResetAnswer.UNREACHABLE, None),
        (ResetAnswer.ERROR, None),
    ],
)
def test_reset_block_success_means_what_the_reference_means(
    outcome: ResetAnswer, success: bool | None
) -> None:
    # The reference reads `success` from a 2xx body only: an engine that could not serve
    # the reset records null there, even though the sidecar's answer says false.
    assert folded(outcome).to_record()["success"] is success


@pytest.mark.parametrize(
    ("requested", "warmup", "outcome", "expected"),
    [
        (Requested.COLD, 0, ResetAnswer.ACKNOWLEDGED, "cold_start"),
        (Requested.COLD, 0, ResetAnswer.ACCEPTED_UNVERIFIED, "cold_start"),
        (Requested.COLD, 0, ResetAnswer.REFUSED, "unspecified"),
        (Requested.COLD, 0, ResetAnswer.UNSUPPORTED, "unspecified"),
        (Requested.COLD, 1, ResetAnswer.ACKNOWLEDGED, "steady_state"),
        (Requested.COLD, 2, ResetAnswer.ACKNOWLEDGED, "steady_state"),
        (Requested.UNSPECIFIED, 0, ResetAnswer.ACKNOWLEDGED, "unspecified"),
    ],
)
def test_run_kind(requested: Requested, warmup: int, outcome: ResetAnswer, expected: str) -> None:
    assert run_kind(requested, warmup, folded(outcome)) == expected


def test_reason_of_an_unconfirmed_reset_names_the_status() -> None:
    record = cache_state_record(
        session_id="s",
        case_id="c",
        requested=Requested.COLD,
        reset=folded(ResetAnswer.ACCEPTED_UNVERIFIED),
        warmup_requests=0,
    )
    assert record["reason"] == (
        "the cache reset returned HTTP 200 without saying whether it succeeded, and no engine adapter can confirm it"
    )
    assert record["acknowledged"] is False and record["attempted"] is True


def test_reason_of_a_failed_reset_quotes_its_error() -> None:
    record = cache_state_record(
        session_id="s",
        case_id="c",
        requested=Requested.COLD,
        reset=folded(ResetAnswer.UNSUPPORTED, status=404, error="HTTP 404"),
        warmup_requests=0,
    )
    assert record["reason"] == "the cache reset failed (unsupported: HTTP 404)"
