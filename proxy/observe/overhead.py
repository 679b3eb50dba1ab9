"""The time the sidecar itself adds to a request, and its quantiles over a case.

Two spans per request, on the monotonic clock (`time.perf_counter_ns`), in whole microseconds:

- `added_in_us`: from the last byte of the client's request read to the last byte written to
  the engine (for a body the sidecar streams as it arrives: from its last piece read);
- `added_out_us`: from the engine's first answer byte read to the first byte written to the
  client; for an SSE stream whose head went out alone, from the read that brought its first
  event to that event written.

The engine's own time (thinking, a slow first token) and the client's (a slow upload) lie
outside both spans by construction: each starts when the sidecar has the bytes in hand and
ends when it has written them. What the sidecar cannot see either way is the kernel's and the
event loop's time before a read reaches Python (bench/paced.py measures it from outside).

Marking costs one clock read each (~50 ns); there is no object per request: the marks are
plain integers on the exchange and on the engine's response.
"""

from __future__ import annotations

import math
from time import perf_counter_ns
from typing import Any

__all__ = ["OverheadQuantiles", "elapsed_us", "now_ns", "overhead_member"]

# The clock of every mark: monotonic, nanoseconds, ~50 ns a read (vDSO).
now_ns = perf_counter_ns

# Values below this are kept exactly; above, to 1/32 of their size (about 3 %).
_EXACT = 64
_SUB = 32  # buckets per power of two above _EXACT


def elapsed_us(since_ns: int, until_ns: int) -> int:
    """Whole microseconds from one mark to a later one (never negative)."""
    return max(0, until_ns - since_ns) // 1000


def overhead_member(added_in_us: int | None, added_out_us: int | None) -> dict[str, int | None] | None:
    """The `overhead` member of an `infer.cache_observation` record (None when neither span was measured)."""
    if added_in_us is None and added_out_us is None:
        return None
    return {"added_in_us": added_in_us, "added_out_us": added_out_us}


def _bucket(value: int) -> int:
    """The bucket of a value: itself below _EXACT, else its power of two and its next five bits."""
    if value < _EXACT:
        return value
    shift = value.bit_length() - 6  # keeps the top 6 bits: 32..63
    return _EXACT + (shift - 1) * _SUB + (value >> shift) - _SUB


def _upper(bucket: int) -> int:
    """The largest value a bucket holds: a quantile is never reported below the value it stands for."""
    if bucket < _EXACT:
        return bucket
    shift, top = divmod(bucket - _EXACT, _SUB)
    shift += 1
    return ((top + _SUB + 1) << shift) - 1


class OverheadQuantiles:
    """The added_in/added_out values of one case, in bounded memory, for their p50 and p99.

    A count per bucket (a few hundred at most: exact to 63 µs, then within 3 %), not the values:
    a case of a million requests costs what one of a thousand does.
    """

    __slots__ = ("_in", "_out")

    def __init__(self) -> None:
        self._in: dict[int, int] = {}
        self._out: dict[int, int] = {}

    def add(self, added_in_us: int | None, added_out_us: int | None) -> None:
        """Count one request's spans (either may be unmeasured)."""
        if added_in_us is not None:
            bucket = _bucket(added_in_us)
            self._in[bucket] = self._in.get(bucket, 0) + 1
        if added_out_us is not None:
            bucket = _bucket(added_out_us)
            self._out[bucket] = self._out.get(bucket, 0) + 1

    def to_json(self) -> dict[str, Any]:
        """`{"added_in_us": {"requests", "p50", "p99"}, "added_out_us": {...}}` (p50/p99 null before any request)."""
        return {"added_in_us": _summary(self._in), "added_out_us": _summary(self._out)}


def _summary(counts: dict[int, int]) -> dict[str, int | None]:
    total = sum(counts.values())
    return {"requests": total, "p50": _quantile(counts, total, 0.5), "p99": _quantile(counts, total, 0.99)}


def _quantile(counts: dict[int, int], total: int, q: float) -> int | None:
    """The nearest-rank quantile (the smallest value with at least q of the requests at or below it)."""
    if not total:
        return None
    rank = max(1, math.ceil(round(q * total, 6)))  # rounded first: 0.99 * 100 is 98.99999999999999
    seen = 0
    for bucket in sorted(counts):
        seen += counts[bucket]
        if seen >= rank:
            return _upper(bucket)
    raise AssertionError("unreachable: the counts add up to total")
