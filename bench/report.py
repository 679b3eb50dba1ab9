"""Turns the benchmark's raw runs into the Markdown table (absolute figures, ratios, aims) and a summary dict."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aims import aims_section, cpu_aims_section
from figures import fmt, median, pct, spread, times

__all__ = ["LABELS", "render"]

LABELS = {
    "direct": "direct to the simulator",
    "cw": "cachewitness (evidence + injection on)",
    "cw-bare": "cachewitness `--no-observe --no-inject-usage`",
    "nginx": "nginx (streaming proxy, 1 worker)",
}
PATHS = tuple(LABELS)
Run = dict[str, Any]


def _runs(runs: list[Run], case: str, conc: int, path: str) -> list[Run]:
    """The rounds of one case on one path, in round order."""
    return sorted(
        (
            r
            for r in runs
            if r["case"] == case and r["concurrency"] == conc and r["path"] == path and "failed" not in r
        ),
        key=lambda r: r["round"],
    )


def _paired(
    runs: list[Run], case: str, conc: int, path: str, base: str, f: Callable[[Run, Run], float | None]
) -> float | None:
    """Median over rounds of f(run on path, run on base in the same round)."""
    mine = {r["round"]: r for r in _runs(runs, case, conc, path)}
    theirs = {r["round"]: r for r in _runs(runs, case, conc, base)}
    return median([f(mine[k], theirs[k]) for k in mine if k in theirs])


def _ratio(key: str) -> Callable[[Run, Run], float | None]:
    """a[key] / b[key]."""
    return lambda a, b: a[key] / b[key] if a.get(key) and b.get(key) else None


def _median_run(rs: list[Run], key: str) -> Run:
    """The round whose `key` is the median (for its bottleneck note)."""
    return sorted(rs, key=lambda r: r[key])[len(rs) // 2]


def render(
    meta: dict[str, Any], runs: list[Run], memory: dict[str, dict[str, float]]
) -> tuple[str, dict[str, Any]]:
    """The Markdown report and the summary behind it."""
    summary: dict[str, Any] = {"nonstream": {}, "stream": {}, "cpu": {}, "memory": memory}
    lines = [
        "## Overhead benchmark: direct vs cachewitness vs nginx",
        "",
        f"`{meta['command']}` — {meta['date']}, {meta['duration_s']} s in all; {meta['cores']} cores "
        f"({meta['cpu']}), Python {meta['python']}, {meta['nginx']}. Simulator: vLLM dialect, decode and "
        f"prefill rate 0. {meta['rounds']} rounds × {meta['seconds']:g} s per case and path; figures are "
        "medians over rounds, ratios are taken within each round (paths run back to back) and then the median.",
        "",
        _pinning_line(meta),
        "",
        "### Non-streaming chat completions (wrk, 16 tokens each)",
        "",
        "| conc. | path | req/s | spread | p50 ms | p90 ms | p99 ms | p50 added vs direct | req/s vs direct "
        "| req/s vs nginx | proxy CPU µs/request | limited by |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for conc in sorted({r["concurrency"] for r in runs if r["case"] == "nonstream"}):
        for path in PATHS:
            rs = _runs(runs, "nonstream", conc, path)
            if not rs:
                continue
            row = {
                "rps": median([r["rps"] for r in rs]),
                "spread": spread([r["rps"] for r in rs]),
                "p50_ms": median([r["p50_ms"] for r in rs]),
                "p90_ms": median([r["p90_ms"] for r in rs]),
                "p99_ms": median([r["p99_ms"] for r in rs]),
                "p50_added_ms": _paired(
                    runs, "nonstream", conc, path, "direct", lambda a, b: a["p50_ms"] - b["p50_ms"]
                ),
                "vs_direct": _paired(runs, "nonstream", conc, path, "direct", _ratio("rps")),
                "vs_nginx": _paired(runs, "nonstream", conc, path, "nginx", _ratio("rps")),
                "cpu_us": _cpu_us(rs, "requests"),
                "errors": sum(r["errors"] for r in rs),
                "limited_by": _median_run(rs, "rps")["bottleneck"],
            }
            summary["nonstream"][f"{conc}/{path}"] = row
            err = f" ({row['errors']:.0f} errors)" if row["errors"] else ""
            lines.append(
                f"| {conc} | {LABELS[path]}{err} | {fmt(row['rps'])} | {fmt(pct(row['spread']), 0, '%')} "
                f"| {fmt(row['p50_ms'], 2)} | {fmt(row['p90_ms'], 2)} | {fmt(row['p99_ms'], 2)} "
                f"| {'—' if path == 'direct' else fmt(row['p50_added_ms'], 2, ' ms')} "
                f"| {times(row['vs_direct'])} | {times(row['vs_nginx'])} | {fmt(row['cpu_us'])} | {row['limited_by']} |"
            )
    lines += [
        "",
        f"### Streaming chat completions ({_tokens(runs)} tokens each, back to back on every connection)",
        "",
        "| streams | path | SSE events/s | spread | TTFB p50 ms | TTFB p99 ms | inter-event gap p99 ms "
        "| events/s vs direct | events/s vs nginx | proxy CPU µs/event | of which user / kernel "
        "| events per proxy read | limited by |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for conc in sorted({r["concurrency"] for r in runs if r["case"] == "stream"}):
        for path in PATHS:
            rs = _runs(runs, "stream", conc, path)
            if not rs:
                continue
            row = {
                "events_per_s": median([r["events_per_s"] for r in rs]),
                "spread": spread([r["events_per_s"] for r in rs]),
                "ttfb_p50_ms": median([r["ttfb_p50_ms"] for r in rs]),
                "ttfb_p99_ms": median([r["ttfb_p99_ms"] for r in rs]),
                "gap_p99_ms": median([r["gap_p99_ms"] for r in rs]),
                "vs_direct": _paired(runs, "stream", conc, path, "direct", _ratio("events_per_s")),
                "vs_nginx": _paired(runs, "stream", conc, path, "nginx", _ratio("events_per_s")),
                "cpu_us": _cpu_us(rs, "events"),
                "user_us": _cpu_us(rs, "events", "proxy_user_s"),
                "kernel_us": _cpu_us(rs, "events", "proxy_system_s"),
                "events_per_read": _per_read(rs),
                "errors": sum(r["errors"] for r in rs),
                "limited_by": _median_run(rs, "events_per_s")["bottleneck"],
            }
            summary["stream"][f"{conc}/{path}"] = row
            err = f" ({row['errors']:.0f} errors)" if row["errors"] else ""
            lines.append(
                f"| {conc} | {LABELS[path]}{err} | {fmt(row['events_per_s'])} | {fmt(pct(row['spread']), 0, '%')} "
                f"| {fmt(row['ttfb_p50_ms'], 1)} | {fmt(row['ttfb_p99_ms'], 1)} | {fmt(row['gap_p99_ms'], 2)} "
                f"| {times(row['vs_direct'])} | {times(row['vs_nginx'])} | {fmt(row['cpu_us'], 2)} "
                f"| {fmt(row['user_us'], 2)} / {fmt(row['kernel_us'], 2)} | {fmt(row['events_per_read'], 1)} "
                f"| {row['limited_by']} |"
            )
    lines += [
        "",
        "The CPU per event moves with how many events each read from the engine carries: each read "
        "and write costs the kernel the same whatever it carries, and a proxy that spends longer per "
        "read finds more events waiting at the next. Reads are the proxy's read-type system calls "
        "(`/proc/PID/io` syscr, which counts read() and readv() as the event loop calls them; nginx "
        "calls recv(), which it does not count: —) over the events the load generator got.",
    ]
    lines += _cpu_section(runs, summary)
    lines += _memory_section(memory)
    lines += aims_section(summary, memory)
    lines += cpu_aims_section(summary, memory, meta)
    lines += _noise_section(runs, meta)
    return "\n".join(lines) + "\n", summary


def _cpu_us(rs: list[Run], count: str, cpu: str = "proxy_cpu_s") -> float | None:
    """The proxy's CPU µs per request (or per SSE event), median over rounds; the direct path has none.

    `cpu`: the proxy's user or system seconds alone (runs from before they were kept have none).
    """
    return median(
        [1e6 * r[cpu] / r[count] for r in rs if r.get(count) and cpu in r and r["path"] != "direct"]
    )


def _per_read(rs: list[Run]) -> float | None:
    """SSE events per read-type system call of the proxy, median over rounds."""
    return median(
        [r["events"] / r["proxy_reads"] for r in rs if r.get("proxy_reads") and r["path"] != "direct"]
    )


def _tokens(runs: list[Run]) -> int:
    """Completion tokens per stream (events minus role, finish and [DONE])."""
    return 256


def _pinning_line(meta: dict[str, Any]) -> str:
    """How the processes shared the cores."""
    pin = meta["pinning"]
    if pin is None:
        return "Processes were not pinned: proxy, simulator and load generator share every core."
    return (
        f"Pinning (taskset): the proxy under test alone on core {pin['proxy']}; the simulator and the load "
        f"generator (wrk, bench/sse_load.py) share core {pin['upstream_and_loadgen']}. The direct path therefore "
        'shows what that one core of simulator + load generator can do; "limited by" says which core was full '
        "(≥ 90 % busy, other people's processes included) during the median round."
    )


def _cpu_section(runs: list[Run], summary: dict[str, Any]) -> list[str]:
    """CPU seconds per 1,000 requests (and streams) of each process."""
    lines = [
        "",
        "### CPU seconds per 1,000 requests",
        "",
        "| path | proxy, non-stream c=64 | proxy, c=16 | → one-core capacity (req/s) | proxy per 1,000 streams "
        "(256 tok, 64 streams) | simulator, c=64 | load generator (wrk), c=64 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def per_1000(case: str, conc: int, path: str, key: str, count: str) -> float | None:
        return median([r[key] / r[count] * 1000 for r in _runs(runs, case, conc, path) if r.get(count)])

    for path in PATHS:
        c64 = per_1000("nonstream", 64, path, "proxy_cpu_s", "requests") if path != "direct" else None
        c16 = per_1000("nonstream", 16, path, "proxy_cpu_s", "requests") if path != "direct" else None
        streams = per_1000("stream", 64, path, "proxy_cpu_s", "streams") if path != "direct" else None
        sim = per_1000("nonstream", 64, path, "upstream_cpu_s", "requests")
        wrk = per_1000("nonstream", 64, path, "loadgen_cpu_s", "requests")
        capacity = 1000 / c64 if c64 else None
        summary["cpu"][path] = {
            "proxy_s_per_1000_c64": c64,
            "proxy_s_per_1000_c16": c16,
            "one_core_capacity_rps": capacity,
            "proxy_s_per_1000_streams": streams,
            "sim_s_per_1000": sim,
            "wrk_s_per_1000": wrk,
        }
        lines.append(
            f"| {LABELS[path]} | {fmt(c64, 3)} | {fmt(c16, 3)} | {fmt(capacity)} | {fmt(streams, 2)} "
            f"| {fmt(sim, 3)} | {fmt(wrk, 3)} |"
        )
    return lines


def _memory_section(memory: dict[str, dict[str, float]]) -> list[str]:
    """Resident memory idle and with 1,000 open streams."""
    nginx_open = memory.get("nginx", {}).get("open_mb")
    lines = [
        "",
        "### Resident memory (RSS, MB)",
        "",
        "| path | idle at start | after the load runs | 1,000 open streams (slow simulator, 1 tok/s) | streams open "
        "| vs nginx |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for path, m in memory.items():
        ratio = m["open_mb"] / nginx_open if nginx_open and path != "nginx" else None
        lines.append(
            f"| {LABELS[path]} | {fmt(m['idle_at_start_mb'], 1)} | {fmt(m['after_load_mb'], 1)} "
            f"| {fmt(m['open_mb'], 1)} | {m['open_streams']:.0f} | {times(ratio)} |"
        )
    lines.append("")
    lines.append(
        "The 1,000-stream figure comes from a fresh sidecar (its idle RSS is in `latest.json`); "
        "nginx's figures add its master and worker."
    )
    return lines


def _noise_section(runs: list[Run], meta: dict[str, Any]) -> list[str]:
    """How busy the machine was with other people's work while we measured."""
    foreign = [r["foreign_cores"] for r in runs]
    failed = [
        f"{r['case']} c={r['concurrency']} {r['path']} round {r['round']}" for r in runs if "failed" in r
    ]
    return [
        "",
        *(
            [f"Failed runs (left out of the medians; see latest.json): {'; '.join(failed)}.", ""]
            if failed
            else []
        ),
        f"Noise: other processes on the machine used a median of {median(foreign):.2f} cores "
        f"(max {max(foreign):.2f}) during the measurements; load average at the end "
        f'{", ".join(f"{x:.1f}" for x in meta["load_avg_at_end"])}. "spread" is (max − min) / median over rounds. '
        "Absolute figures move with that load; the ratios much less.",
    ]
