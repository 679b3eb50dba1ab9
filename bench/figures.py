"""How the benchmark's figures are summarised and written in its tables."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["fmt", "median", "pct", "spread", "times"]


def median(values: Sequence[float | None]) -> float | None:
    """Median of the values given (None: not measured), or None for none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def spread(values: list[float]) -> float | None:
    """(max - min) / median: how much the rounds disagreed."""
    mid = median(values)
    return (max(values) - min(values)) / mid if values and mid else None


def fmt(value: float | None, digits: int = 0, suffix: str = "") -> str:
    """A number for the table, or a dash."""
    if value is None:
        return "—"
    return f"{value:,.{digits}f}{suffix}"


def times(value: float | None) -> str:
    """A ratio as `0.87×`."""
    return "—" if value is None else f"{value:.2f}×"


def pct(value: float | None) -> float | None:
    """A fraction as a percentage."""
    return None if value is None else value * 100
