"""The one self-contained HTML page of `cachewitness report`: the case table and two plots.

Everything is inline (CSS, SVG); the page loads nothing and runs no script, and says so to the
browser with a `default-src 'none'` content security policy. Every value from the evidence is
HTML-escaped: ids are the benchmark's words, not ours.
"""

from __future__ import annotations

from html import escape

from proxy.cli.report.data import COLUMNS, Heat, ReportData
from proxy.cli.report.svg import Mark, Plot, Point, scatter

__all__ = ["render_page"]

_CSP = "default-src 'none'; style-src 'unsafe-inline'"

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2330; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 6px; }
p.meta, p.note { color: #5a6272; margin: 2px 0; }
table { border-collapse: collapse; margin-top: 8px; }
th, td { border: 1px solid #d5d9e0; padding: 4px 8px; text-align: left; white-space: nowrap; }
th { background: #f1f3f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.verified, td.consistent { color: #12733b; font-weight: 600; }
td.contradicted, td.inconsistent { color: #b3261e; font-weight: 600; }
td.unverified, td.pending, td.inconclusive { color: #8a5a00; }
svg.plot { display: block; margin-top: 4px; }
svg .frame { fill: #fafbfc; stroke: #c4c9d2; } svg .grid { stroke: #e6e9ee; }
svg text { font: 11px system-ui, sans-serif; fill: #5a6272; } svg text.axis { font-size: 12px; fill: #1d2330; }
svg circle.cold { fill: #2563eb; } svg circle.warm { fill: #ea580c; } svg circle.unknown { fill: #9ca3af; }
svg circle.tokens { fill: #0f766e; }
svg circle.isolated { stroke: #1d2330; stroke-width: 1.5; } svg circle.isolated.contradicted { stroke: #b3261e; stroke-width: 3; }
span.key.isolated { background: #fff; border: 1.5px solid #1d2330; }
svg .reset line { stroke-width: 1.5; stroke-dasharray: 4 3; } svg .reset text { font-size: 10px; }
svg .reset.verified line { stroke: #12733b; } svg .reset.contradicted line { stroke: #b3261e; }
svg .reset.unverified line { stroke: #8a5a00; }
span.key { display: inline-block; width: 10px; height: 10px; border-radius: 5px; margin: 0 4px 0 12px; }
span.key.cold { background: #2563eb; } span.key.warm { background: #ea580c; }
span.key.unknown { background: #9ca3af; }
"""

_NUMERIC = frozenset(
    {"requests", "prompt tokens", "cached tokens", "hit ratio", "first byte p50", "sidecar added p50 / p99"}
)
_WORD_COLUMNS = frozenset({"verified", "verdict"})


def _table(data: ReportData) -> str:
    """The case table: one row a case, every cell escaped."""
    head = "".join(f"<th>{escape(name)}</th>" for name in COLUMNS)
    rows = []
    for case in data.cases:
        cells = []
        for name, value in zip(COLUMNS, case.cells(), strict=True):
            css = "num" if name in _NUMERIC else (value if name in _WORD_COLUMNS else "")
            attribute = f' class="{escape(css)}"' if css else ""
            cells.append(f"<td{attribute}>{escape(value)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    if not rows:
        rows.append(f'<tr><td colspan="{len(COLUMNS)}">no cases</td></tr>')
    return f'<table id="cases"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _reset_marks(data: ReportData) -> tuple[Mark, ...]:
    origin = data.origin_ns
    return tuple(
        Mark(
            x=(reset.at_ns - origin) / 1e9,
            css=reset.verified,
            label=reset.case_id or "reset",
            title=f"reset for case {reset.case_id or '-'}: {reset.verified}",
        )
        for reset in data.resets
    )


def _cached_plot(data: ReportData) -> str:
    origin = data.origin_ns
    points = tuple(
        Point(
            x=(p.started_ns - origin) / 1e9,
            y=float(p.cached_tokens),
            css=p.css("tokens"),
            title=f"case {p.case_id or '-'}: {p.cached_tokens} of {p.prompt_tokens} prompt tokens cached{p.words}",
        )
        for p in data.requests
        if p.cached_tokens is not None
    )
    return scatter(
        Plot(
            plot_id="cached-plot",
            title="Cached tokens per request, resets marked",
            x_label="seconds since the session's first record",
            y_label="cached tokens",
            points=points,
            marks=_reset_marks(data),
        )
    )


def _ttft_plot(data: ReportData) -> str:
    origin = data.origin_ns
    points = tuple(
        Point(
            x=(p.started_ns - origin) / 1e9,
            y=p.ttft_ms,
            css=p.css(p.heat.value),
            title=f"case {p.case_id or '-'}: {p.ttft_ms:.1f} ms, {p.heat.value}{p.words}"
            + _added_text(p.added_us),
        )
        for p in data.requests
        if p.ttft_ms is not None
    )
    return scatter(
        Plot(
            plot_id="ttft-plot",
            title="Time to first byte per request, cold or warm",
            x_label="seconds since the session's first record",
            y_label="first byte (ms)",
            points=points,
            marks=_reset_marks(data),
        )
    )


def _added_text(added_us: int | None) -> str:
    """The sidecar's own share of a request's time, beside its time to first byte."""
    return f"; the sidecar added {added_us} µs" if added_us is not None else ""


def _counts(data: ReportData) -> str:
    verified = sum(1 for case in data.cases if case.verified == "verified")
    return (
        f"{len(data.cases)} cases, {verified} with a verified reset; "
        f"{len(data.requests)} requests, {len(data.resets)} resets"
    )


def render_page(data: ReportData, *, source: str) -> str:
    """The whole page for one session; `source` says where the records came from (credentials removed)."""
    keys = "".join(f'<span class="key {h.value}"></span>{h.value}' for h in Heat)
    keys += '<span class="key isolated"></span>isolated (ringed red: contradicted)'
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>cachewitness report: {escape(data.session_id)}</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>cachewitness report: session <span id="session">{escape(data.session_id)}</span></h1>
<p class="meta">{escape(_counts(data))}. Records from {escape(source)}.</p>
<h2>Cases</h2>
{_table(data)}
<p class="note">verified: what the reset's witnesses proved; verdict: what the case's own requests showed;
bypass: requests the engine counted that did not pass the sidecar (- where its counters were not read);
sidecar added: the time the sidecar itself added to each request, its way in and its way out
(evidence.md, "The sidecar's added time"), beside the requests' median time to first byte.</p>
<h2>Cached tokens per request</h2>
{_cached_plot(data)}
<p class="note">Dashed lines are resets (green verified, red contradicted, amber unverified).</p>
<h2>Time to first byte per request</h2>
{_ttft_plot(data)}
<p class="note">{keys}. From the request reaching the sidecar to the first byte of the answer it sent back:
the time to first token for a stream whose engine sends its head with the first token, the whole answer's time
for a request that does not stream. Cold: 0 cached tokens reported, warm: some, unknown: the engine did not say.
Each point's title says how much of it the sidecar itself added.</p>
</body>
</html>
"""
