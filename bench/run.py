"""`make bench`: direct vs cachewitness vs nginx, side by side, against the simulator at decode rate 0.

    .venv/bin/python bench/run.py [--seconds 3] [--rounds 3] [--no-pin] [--quick]

Starts (all on loopback free ports, everything under one temp dir): the vLLM simulator
(decode/prefill rate 0), cachewitness with evidence and usage injection on, cachewitness
with `--no-observe --no-inject-usage`, and nginx (one worker, `daemon off`, streaming
reverse proxy). With 2+ cores the proxy under test runs alone on one core, the simulator
and the load generator share the other (taskset), so every path gets the same upstream
and load-generator capacity. Each case runs every path back to back, `--rounds` times;
the table gives the median and the ratios taken within each round (robust on a noisy
shared machine). Writes bench/results/latest.md and latest.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Cores, rss_mb
from loads import run_sse, run_wrk
from paths import Bench
from report import render

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PATHS = ("direct", "cw", "cw-bare", "nginx")
NONSTREAM_CONCURRENCY = (1, 16, 64)
STREAM_CONCURRENCY = (64, 256)
STREAM_TOKENS = 256


def main() -> int:
    """Run every case, write the results, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each measurement")
    parser.add_argument("--rounds", type=int, default=3, help="times each case runs on every path")
    parser.add_argument("--quick", action="store_true", help="1 round of 2 s (a smoke run)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument(
        "--render", type=Path, metavar="JSON", help="only re-render the table from a latest.json"
    )
    ns = parser.parse_args()
    if ns.render is not None:
        saved = json.loads(ns.render.read_text())
        markdown, _ = render(saved["meta"], saved["runs"], saved["memory"])
        print(markdown)
        return 0
    if ns.quick:
        ns.seconds, ns.rounds = 2.0, 1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (min(hard, max(soft, 16384)), hard)
    )  # 1,000 streams = 2,000+ fds
    os.chdir(ROOT)
    started = time.time()
    runs: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="cw-bench-") as tmp_name:
        bench = Bench(Path(tmp_name), pin=not ns.no_pin)
        try:
            rest = Cores.prefix(bench.cores.rest)
            for path in PATHS:  # warm-up: imports, connection pools, JIT-free but cache-warm
                run_wrk(bench.wrk, rest, bench.script, bench.url(path), 16, 1)
            for rnd in range(ns.rounds):
                for conc in NONSTREAM_CONCURRENCY:
                    for path in PATHS:
                        r = bench.measure(
                            path,
                            partial(
                                run_wrk, bench.wrk, rest, bench.script, bench.url(path), conc, ns.seconds
                            ),
                        )
                        runs.append(
                            {"case": "nonstream", "concurrency": conc, "path": path, "round": rnd, **r}
                        )
                        _progress(runs[-1])
                for conc in STREAM_CONCURRENCY:
                    for path in PATHS:
                        r = bench.measure(
                            path,
                            partial(run_sse, rest, bench.url(path), conc, ns.seconds, STREAM_TOKENS),
                        )
                        runs.append({"case": "stream", "concurrency": conc, "path": path, "round": rnd, **r})
                        _progress(runs[-1])
            memory = {
                path: {
                    "idle_at_start_mb": bench.idle_rss[path],
                    "after_load_mb": rss_mb(bench.services[path].pids()),
                }
                for path in ("cw", "cw-bare", "nginx")
            }
            for path in ("cw", "cw-bare", "nginx"):
                memory[path].update(bench.open_streams_rss(path))
                print(f"  memory {path:8s} {memory[path]}", flush=True)
        finally:
            bench.stop()
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "duration_s": round(time.time() - started, 1),
            "command": " ".join([".venv/bin/python bench/run.py", *sys.argv[1:]]),
            "seconds": ns.seconds,
            "rounds": ns.rounds,
            "cores": os.cpu_count(),
            "pinning": None
            if bench.cores.proxy is None
            else {"proxy": bench.cores.proxy, "upstream_and_loadgen": bench.cores.rest},
            "cpu": _cpu_model(),
            "python": platform.python_version(),
            "nginx": subprocess.run([bench.nginx_bin, "-v"], capture_output=True, text=True).stderr.strip(),
            "load_avg_at_end": os.getloadavg(),
        }
    markdown, summary = render(meta, runs, memory)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "latest.md").write_text(markdown)
    (ns.out / "latest.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "memory": memory, "runs": runs}, indent=1) + "\n"
    )
    print()
    print(markdown)
    print(f"written: {ns.out / 'latest.md'}, {ns.out / 'latest.json'}")
    return 0


def _progress(run: dict[str, object]) -> None:
    """One line per measurement, so a long run shows it is alive."""
    if "failed" in run:
        print(
            f"  r{run['round']} {run['case']:9s} c={run['concurrency']:<3} {run['path']:8s} FAILED",
            flush=True,
        )
        return
    figure = f"{run['rps']:8.0f} req/s" if run["case"] == "nonstream" else f"{run['events_per_s']:8.0f} ev/s"
    print(
        f"  r{run['round']} {run['case']:9s} c={run['concurrency']:<3} {run['path']:8s} {figure}  "
        f"proxy {run['proxy_cpu_s']:.2f}s cpu  foreign {run['foreign_cores']:.2f} cores  [{run['bottleneck']}]",
        flush=True,
    )


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
