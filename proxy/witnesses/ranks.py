"""Every data-parallel rank: a canary per rank, and one verification that lists them (docs/reset.md).

An engine under data parallelism keeps one cache per rank, and its reset route may answer with
one rank's result only (SGLang answers `/flush_cache` with the first rank's). Each rank is
proven on its own: the canary's whole run (C1, its repeat, C2, reset, probes, resets) with every
request routed to that rank (vLLM's `X-data-parallel-rank` header; SGLang's body fields too).
The reset is `verified` only when every rank is; one rank still cached makes it `contradicted`,
and a rank that could not be proven leaves it `unverified` (a 200 answers `accepted_unverified`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from proxy.engines.base import CacheReset
from proxy.vocabulary import Verified, VerifyMode
from proxy.witnesses.canary import Canary, ResetCall, verify_reset
from proxy.witnesses.counters import Sums
from proxy.witnesses.verification import Verification

__all__ = ["rank_entries", "spent", "verify_ranks"]


async def verify_ranks(canaries: Sequence[Canary], reset: ResetCall) -> tuple[CacheReset, Verification]:
    """One canary run per rank, in rank order; the first run's reset is the reset, every call listed."""
    runs: list[tuple[int, Verification]] = []
    main: CacheReset | None = None
    calls: list[Any] = []
    for canary in canaries:
        done, verification = await verify_reset(canary, reset)
        calls.extend(done.calls)
        runs.append((canary.rank or 0, verification))
        if main is None:
            main = done
            if not done.succeeded:
                break  # the engine refused the reset itself: no rank can be proven
    assert main is not None, "verify_ranks needs at least one canary"
    ranks = tuple(_entry(rank, verification) for rank, verification in runs)
    missing = [canary.rank or 0 for canary in canaries[len(runs) :]]
    ranks += tuple(
        {"rank": rank, "verified": Verified.UNVERIFIED.value, "reason": "the reset was not accepted"}
        for rank in missing
    )
    return replace(main, calls=tuple(calls)), _combined(runs, ranks)


def _entry(rank: int, verification: Verification) -> dict[str, Any]:
    """One rank in the answer's `ranks`."""
    return {
        "rank": rank,
        "verified": verification.verified.value,
        "reason": verification.reason,
        "before": verification.before.to_json() if verification.before is not None else None,
        "after": [reading.to_json() for reading in verification.after],
    }


def _combined(runs: list[tuple[int, Verification]], ranks: tuple[dict[str, Any], ...]) -> Verification:
    """The reset's verification: contradicted if any rank is, verified only if every rank is."""
    first = runs[0][1]
    contradicted = [(rank, v) for rank, v in runs if v.verified == Verified.CONTRADICTED]
    unproven = [entry for entry in ranks if entry["verified"] != Verified.VERIFIED.value]
    if contradicted:
        rank, worst = contradicted[0]
        verified, reason, hint = Verified.CONTRADICTED, f"rank {rank}: {worst.reason}", worst.hint
    elif unproven:
        verified, hint = Verified.UNVERIFIED, None
        reason = f"rank {unproven[0]['rank']} was not proven: {unproven[0]['reason']}"
    else:
        verified, hint = Verified.VERIFIED, None
        reason = (
            f"each of the {len(ranks)} data-parallel ranks was verified; rank {runs[0][0]}: {first.reason}"
        )
    by_tier: dict[str, int] | None = {}
    for _rank, v in runs:
        if v.cached_by_tier is None or by_tier is None:
            by_tier = None
            continue
        for tier, tokens in v.cached_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + tokens
    return Verification(
        VerifyMode.CANARY,
        verified,
        reason,
        first.canary_tokens,
        first.before,
        tuple(reading for _rank, v in runs for reading in v.after),
        sum(v.elapsed_s for _rank, v in runs),
        hint,
        cached_by_tier=by_tier,
        ranks=ranks,
    )


def rank_entries(ranks: Sequence[int], verification: Verification, by: str) -> tuple[dict[str, Any], ...]:
    """`ranks` where no canary ran per rank: each rank as the one witness that ran says (`by`)."""
    state = verification.verified.value if by == "events" else Verified.UNVERIFIED.value
    reason = verification.reason if by == "events" else f"no canary was run per rank ({verification.reason})"
    return tuple({"rank": rank, "verified": state, "reason": reason, "by": by} for rank in ranks)


def spent(canaries: Sequence[Canary]) -> Sums:
    """What every canary's answered requests added to the engine's counters."""
    total = Sums()
    for canary in canaries:
        total = total.add(canary.spent)
    return total
