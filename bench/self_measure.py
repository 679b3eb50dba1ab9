"""The sidecar's own measure of its added time over one run: `cachewitness_added_seconds` read before
and after, the difference's p50 and p99 per direction (bench/paced.py prints them beside the
added time it measures from outside).

The quantiles are read from the histogram's buckets as Prometheus's `histogram_quantile` reads
them: linearly within the bucket the rank falls in (1-1.5-2-3-5-7.5 µs a decade, so within a few
µs at tens of µs).
"""

from __future__ import annotations

import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Buckets", "added_buckets", "quantile_us", "run_quantiles"]

FAMILY = "cachewitness_added_seconds"
DIRECTIONS = ("in", "out")

# direction -> ((upper bound in seconds, cumulative count), ...), bounds ascending, +Inf last
Buckets = dict[str, tuple[tuple[float, float], ...]]


def parse_buckets(text: str) -> Buckets:
    """The added-time histogram's cumulative buckets per direction, from a /metrics text."""
    found: dict[str, list[tuple[float, float]]] = {d: [] for d in DIRECTIONS}
    for family in text_string_to_metric_families(text):
        if family.name != FAMILY:
            continue
        for sample in family.samples:
            if sample.name == FAMILY + "_bucket" and sample.labels.get("direction") in found:
                found[sample.labels["direction"]].append((float(sample.labels["le"]), sample.value))
    return {d: tuple(sorted(pairs)) for d, pairs in found.items()}


def added_buckets(url: str, timeout: float = 10.0) -> Buckets | None:
    """The sidecar at `url`'s histogram now; None when it cannot be read (it is then left out)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as response:
            return parse_buckets(response.read().decode())
    except (OSError, ValueError):
        return None


def quantile_us(buckets: tuple[tuple[float, float], ...], q: float) -> float | None:
    """The q-quantile in µs of cumulative buckets (None when empty), linear within its bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound * 1e6  # past the last finite bound: that bound, as Prometheus does
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return (lower_bound + (bound - lower_bound) * share) * 1e6
        lower_bound, lower_count = bound, count
    return None


def run_quantiles(before: Buckets | None, after: Buckets | None) -> dict[str, float | None]:
    """`self_in_p50_us`, `self_in_p99_us`, `self_out_p50_us`, `self_out_p99_us` over one run (None unread)."""
    result: dict[str, float | None] = {}
    for direction in DIRECTIONS:
        delta: tuple[tuple[float, float], ...] = ()
        if before is not None and after is not None:
            start = dict(before.get(direction, ()))
            delta = tuple((bound, count - start.get(bound, 0.0)) for bound, count in after.get(direction, ()))
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            result[f"self_{direction}_{name}_us"] = quantile_us(delta, q)
    return result
