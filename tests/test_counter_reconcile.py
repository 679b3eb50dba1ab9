"""The counter witness's arithmetic (proxy/witnesses/counters.py `reconcile`, pure): which bypass
makes which case verdict. The same on the simulator, over sockets: tests/test_case_witness.py."""

from __future__ import annotations

from proxy.engines.counters import Totals
from proxy.witnesses.counters import CaseVerdict, Sums, reconcile

BEFORE = Totals(requests=10, prompt_tokens=1_000, cached_tokens=200)
# What the sidecar saw between the two reads: two requests, 300 prompt tokens, none cached.
SEEN = Sums(requests=2, prompt_tokens=300, cached_tokens=0)


def _verdict(after: Totals) -> tuple[dict[str, int | None] | None, CaseVerdict, str]:
    """The bypass, verdict and reason of one sequence from BEFORE to `after`, SEEN in between."""
    _deltas, bypass, restarted, verdict, reason = reconcile(
        BEFORE,
        after,
        seen=SEEN,
        canary=Sums(),
        in_flight_at_read=1,
        restart_seen=None,
        restart_before_traffic=False,
    )
    assert not restarted
    return bypass, verdict, reason


def test_counters_that_match_what_the_sidecar_saw_are_consistent() -> None:
    bypass, verdict, _ = _verdict(Totals(requests=12, prompt_tokens=1_300, cached_tokens=200))
    assert bypass == {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
    assert verdict is CaseVerdict.CONSISTENT


def test_prompt_tokens_the_sidecar_did_not_see_are_unseen_traffic_though_the_request_count_agrees() -> None:
    """Requests agree (a request of ours lost in the engine's count, one of another's counted), tokens do not."""
    bypass, verdict, reason = _verdict(Totals(requests=12, prompt_tokens=1_350, cached_tokens=200))
    assert bypass == {"requests": 0, "prompt_tokens": 50, "cached_tokens": 0}
    assert verdict is CaseVerdict.INCONCLUSIVE
    assert reason.startswith("traffic the sidecar did not see reached the engine"), reason


def test_an_engine_counting_one_request_less_than_the_sidecar_saw_lags_it() -> None:
    """One request still in flight at the read: not a consistent case, and not a bypass either."""
    bypass, verdict, reason = _verdict(Totals(requests=11, prompt_tokens=1_300, cached_tokens=200))
    assert bypass == {"requests": -1, "prompt_tokens": 0, "cached_tokens": 0}
    assert verdict is CaseVerdict.INCONCLUSIVE
    assert reason == "the engine's counters lag what the sidecar saw (1 requests in flight at the read)"
