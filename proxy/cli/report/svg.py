"""Inline SVG scatter plots for `cachewitness report`: axes, ticks, points, vertical marks.

Plain SVG elements only (no script, no external font or image), so the page works offline
under a `default-src 'none'` content security policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

__all__ = ["Mark", "Plot", "Point", "nice_ticks", "scatter"]

WIDTH = 760
HEIGHT = 280
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 28, 44


@dataclass(frozen=True)
class Point:
    """One dot: x and y in data units, a CSS class (its colour) and a tooltip."""

    x: float
    y: float
    css: str
    title: str


@dataclass(frozen=True)
class Mark:
    """A vertical line at x (a reset), with a short label above the plot and a tooltip."""

    x: float
    css: str
    label: str
    title: str


@dataclass(frozen=True)
class Plot:
    """A scatter plot's content and labels."""

    plot_id: str
    title: str
    x_label: str
    y_label: str
    points: tuple[Point, ...]
    marks: tuple[Mark, ...] = ()


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values (1, 2 or 5 times a power of ten apart) covering low..high."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    ticks: list[float] = []
    value = first
    while value <= high + step * 1e-9 and len(ticks) < 50:  # bounded: at most 50 ticks
        ticks.append(round(value, 10))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 10))
    return ticks


def _label(value: float) -> str:
    return f"{value:g}"


def _scale(low: float, high: float, out_low: float, out_high: float) -> tuple[float, float]:
    """(factor, offset) mapping low..high onto out_low..out_high."""
    span = high - low if high > low else 1.0
    factor = (out_high - out_low) / span
    return factor, out_low - low * factor


def scatter(plot: Plot) -> str:
    """The plot as one `<svg>` element (an empty plot says so in its middle)."""
    xs = [p.x for p in plot.points] + [m.x for m in plot.marks]
    ys = [p.y for p in plot.points]
    x_ticks = nice_ticks(0.0, max(xs, default=1.0))
    y_ticks = nice_ticks(0.0, max(ys, default=1.0))
    x0, x1 = _LEFT, WIDTH - _RIGHT
    y0, y1 = HEIGHT - _BOTTOM, _TOP
    fx, ox = _scale(x_ticks[0], x_ticks[-1], x0, x1)
    fy, oy = _scale(y_ticks[0], y_ticks[-1], y0, y1)
    parts = [
        f'<svg id="{escape(plot.plot_id)}" class="plot" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(plot.title)}</title>",
        f'<rect class="frame" x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}"/>',
    ]
    for tick in x_ticks:
        x = fx * tick + ox
        parts.append(f'<line class="grid" x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y1}"/>')
        parts.append(
            f'<text class="tick" x="{x:.1f}" y="{y0 + 16}" text-anchor="middle">{_label(tick)}</text>'
        )
    for tick in y_ticks:
        y = fy * tick + oy
        parts.append(f'<line class="grid" x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}"/>')
        parts.append(
            f'<text class="tick" x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{_label(tick)}</text>'
        )
    for mark in plot.marks:
        x = fx * mark.x + ox
        parts.append(
            f'<g class="reset {escape(mark.css)}"><title>{escape(mark.title)}</title>'
            f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y1}"/>'
            f'<text x="{x + 3:.1f}" y="{y1 - 6}">{escape(mark.label)}</text></g>'
        )
    for point in plot.points:
        parts.append(
            f'<circle class="{escape(point.css)}" cx="{fx * point.x + ox:.1f}" cy="{fy * point.y + oy:.1f}" '
            f'r="4"><title>{escape(point.title)}</title></circle>'
        )
    if not plot.points:
        parts.append(
            f'<text class="empty" x="{(x0 + x1) / 2}" y="{(y0 + y1) / 2}" text-anchor="middle">'
            "no requests recorded</text>"
        )
    parts.append(
        f'<text class="axis" x="{(x0 + x1) / 2}" y="{HEIGHT - 6}" text-anchor="middle">{escape(plot.x_label)}</text>'
    )
    parts.append(
        f'<text class="axis" transform="translate(14 {(y0 + y1) / 2}) rotate(-90)" text-anchor="middle">'
        f"{escape(plot.y_label)}</text>"
    )
    parts.append("</svg>")
    return "\n".join(parts)
