"""`make bench`, paced half: cachewitness, bare, Envoy and nginx at the load a deployment offers.

    .venv/bin/python bench/paced.py [--rounds 2] [--quick] [--realtime] [--no-pin] [--cases r400,streams]
        [--paths cw,cw-bare]
        [--sidecar-python /usr/bin/python3.11]
    .venv/bin/python bench/paced.py --render bench/results/paced.json

The vLLM simulator decodes at 100 tokens/s per sequence (prefill instant), so answers last as
long as they would on an engine and the proxy is woken as it would be there. Cases, each
offered open-loop by bench/paced_load.py at the same schedule to every path:

- 400 requests/s over 48 keep-alive connections, 8 tokens each (~80 ms): CPU per request, added p50;
- 100 streams of 200 tokens paced by the engine: CPU per SSE event, added time to first event;
- 100 and 1,600 requests/s: CPU per request (1,600/s at 2 tokens, see CASES);
- a 220 KB chat request at 20 requests/s over 8 connections: added p50 and CPU per request.

Beside each sidecar's added time measured from outside: its own (`cachewitness_added_seconds`,
read before and after each run), p50 and p99 of each direction (bench/self_measure.py).

"Added" is the path's p50 minus the engine's own: a smaller load of the same requests sent
straight to the simulator by the same generator meanwhile (the baseline). Every proxy runs
pinned alone on one core (taskset), the simulator and the load generator on the other; Envoy
with `--concurrency 1`, nginx with one worker. A proxy's CPU is every thread of it and of its
children (nginx's worker), read from /proc by the load generator over exactly its measured
window. Each case runs every path back to back, in an order that turns each round; a figure
is the best of the rounds, and its ratio to Envoy's is of the two best. `--realtime` (root):
everything under SCHED_FIFO, for a machine shared with other work (bench/README.md).
`--sidecar-python`: the interpreter the sidecars run on (bench/interpreters.py). Writes
bench/results/paced.md and paced.json and prints the table.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from envoy_conf import ensure_envoy, envoy_version, start_envoy
from harness import (
    RT_LOADGEN_PRIORITY,
    RT_PROXY_PRIORITY,
    Cores,
    Service,
    cpu_seconds,
    ensure_tools,
    machine_busy_seconds,
    realtime,
    set_fifo,
    start_simulator,
)
from interpreters import describe, sidecar_python
from nginx_conf import start_nginx
from paced_report import render
from paths import BARE, start_sidecar
from self_measure import added_buckets, run_quantiles

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROXIES = ("cw", "cw-bare", "envoy", "nginx")
DECODE_RATE = 100.0  # tokens/s per sequence, the simulator's pace


@dataclass(frozen=True)
class Case:
    """One offered load: the generator's arguments, and the baseline's sent straight to the engine meanwhile."""

    name: str
    argv: tuple[str, ...]
    seconds: float
    baseline: tuple[str, ...] = ()  # a smaller load to the engine itself: the added latency's baseline


CASES = (
    Case(
        "r400",
        ("requests", "--rate", "400", "--connections", "48", "--max-tokens", "8"),
        5.0,
        ("--baseline-rate", "100", "--baseline-connections", "12"),
    ),
    Case(
        "streams",
        ("streams", "--streams", "100", "--max-tokens", "200"),
        6.0,
        ("--baseline-streams", "5", "--baseline-max-tokens", "8"),
    ),
    Case("r100", ("requests", "--rate", "100", "--connections", "48", "--max-tokens", "8"), 6.0),
    # 2 tokens (~20 ms, 32 in flight as at 400/s): 1,600 × 8 paced tokens/s is more than the
    # simulator's core can decode beside the load generator; a non-streaming answer is one
    # body to the proxy whatever its length.
    Case("r1600", ("requests", "--rate", "1600", "--connections", "48", "--max-tokens", "2"), 3.0),
    Case(
        "large",
        ("requests", "--rate", "20", "--connections", "8", "--max-tokens", "8", "--prompt-bytes", "220000"),
        10.0,
        ("--baseline-rate", "10", "--baseline-connections", "4"),
    ),
    # The large case's load with a short prompt: what of the large case's CPU and added time
    # is the 220 KB body, and what its rate (a request every 50 ms runs cold).
    Case(
        "small20",
        ("requests", "--rate", "20", "--connections", "8", "--max-tokens", "8"),
        10.0,
        ("--baseline-rate", "10", "--baseline-connections", "4"),
    ),
)


def main() -> int:
    """Start everything, run the rounds, write and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="times each case runs on every path")
    parser.add_argument("--quick", action="store_true", help="1 round, every case half as long (a smoke run)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="run everything started under SCHED_FIFO (root): on a machine shared with other work "
        "each process then runs when woken, as on a dedicated core",
    )
    parser.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated subset")
    parser.add_argument(
        "--paths",
        default=",".join(PROXIES),
        help="comma-separated subset of the paths (cw,cw-bare: the sidecars alone, no ratio to Envoy's)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument(
        "--sidecar-python",
        metavar="PATH",
        help="the interpreter both sidecars run on (a venv of it is made under .cache/ when it lacks "
        "the project's dependencies; default: this one): a deployment's is optimized (bench/interpreters.py)",
    )
    parser.add_argument(
        "--render", type=Path, metavar="JSON", help="only re-render the tables from a paced.json"
    )
    ns = parser.parse_args()
    if ns.render is not None:
        saved = json.loads(ns.render.read_text())
        print(render(saved["meta"], saved["runs"])[0])
        return 0
    scale = 0.5 if ns.quick else 1.0
    rounds = 1 if ns.quick else ns.rounds
    cases = [c for c in CASES if c.name in ns.cases.split(",")]
    paths = tuple(p for p in PROXIES if p in ns.paths.split(","))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 16384)), hard))
    os.chdir(ROOT)
    started = time.time()
    nginx_bin = ensure_tools()[0] if "nginx" in paths else ""
    envoy_bin = ensure_envoy() if "envoy" in paths else ""
    python = sidecar_python(ns.sidecar_python)
    if ns.realtime:  # after any install: apt-get and pip need not run so
        realtime()
    cores = Cores.choose(pin=not ns.no_pin)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cw-paced-") as tmp_name:
        work = Path(tmp_name)
        services = _start(work, cores, paths, (nginx_bin, envoy_bin), python, ns.realtime)
        try:
            for path in paths:  # warm-up: imports, pools, first connections
                _generate(
                    services,
                    cores,
                    path,
                    ("requests", "--rate", "100", "--max-tokens", "2"),
                    1.0,
                    ns.realtime,
                )
            for rnd in range(rounds):
                for case in cases:
                    turn = rnd % len(paths)
                    baseline = (
                        ("--baseline-url", services["sim"].url, *case.baseline) if case.baseline else ()
                    )
                    for path in paths[turn:] + paths[:turn]:
                        argv = (*case.argv, *baseline)
                        result = _generate(services, cores, path, argv, case.seconds * scale, ns.realtime)
                        runs.append({"case": case.name, "path": path, "round": rnd, **result})
                        _progress(runs[-1])
        finally:
            for service in services.values():
                service.stop()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "duration_s": round(time.time() - started, 1),
        "command": " ".join([".venv/bin/python bench/paced.py", *sys.argv[1:]]),
        "rounds": rounds,
        "scale": scale,
        "decode_rate": DECODE_RATE,
        "cores": os.cpu_count(),
        "realtime": ns.realtime,
        "pinning": None
        if cores.proxy is None
        else {"proxy": cores.proxy, "upstream_and_loadgen": cores.rest},
        "python": platform.python_version(),
        "sidecar_python": describe(python),
        "nginx": subprocess.run([nginx_bin, "-v"], capture_output=True, text=True).stderr.strip()
        if nginx_bin
        else "nginx not run",
        "envoy": envoy_version(envoy_bin) if envoy_bin else "Envoy not run",
        "load_avg_at_end": os.getloadavg(),
    }
    markdown, summary = render(meta, runs)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "paced.md").write_text(markdown)
    (ns.out / "paced.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1) + "\n"
    )
    print()
    print(markdown)
    print(f"written: {ns.out / 'paced.md'}, {ns.out / 'paced.json'}")
    return 0


def _start(
    work: Path, cores: Cores, paths: tuple[str, ...], binaries: tuple[str, str], python: str, rt: bool
) -> dict[str, Service]:
    """The paced simulator and the four proxies in front of it (under --realtime, proxies above the rest).

    The simulator stays off the proxy's core even where that core has time left: an RT task
    there would have the kernel's RT throttle stall the proxy once the two together fill it.
    """
    sim = start_simulator(cores.rest, work, decode_rate=DECODE_RATE)
    services = {"sim": sim}
    nginx_bin, envoy_bin = binaries
    try:
        if "cw" in paths:
            services["cw"] = start_sidecar("cw", sim.url, [], cores.proxy, work, python=python)
        if "cw-bare" in paths:
            services["cw-bare"] = start_sidecar("cw-bare", sim.url, BARE, cores.proxy, work, python=python)
        if "envoy" in paths:
            services["envoy"] = start_envoy(envoy_bin, cores.proxy, work, sim.url)
        if "nginx" in paths:
            services["nginx"] = start_nginx(nginx_bin, cores.proxy, work, [sim.url])[0]
        if rt:
            for name in paths:
                set_fifo(services[name].pids(), RT_PROXY_PRIORITY)
    except BaseException:
        for service in services.values():
            service.stop()
        raise
    return services


def _generate(
    services: dict[str, Service],
    cores: Cores,
    path: str,
    argv: tuple[str, ...],
    seconds: float,
    rt: bool,
) -> dict[str, Any]:
    """One run of the load generator against one proxy, with how busy the machine was meanwhile."""
    service = services[path]
    proxy_pids = service.pids()
    sim_pids = services["sim"].pids()
    ours = sorted({p for s in services.values() for p in s.pids()})
    command = [
        *Cores.prefix(cores.rest),
        sys.executable,
        str(HERE / "paced_load.py"),
        *argv,
        *("--url", service.url, "--seconds", f"{seconds:g}"),
        *("--cpu-pids", ",".join(map(str, proxy_pids))),
        *(("--fifo-priority", str(RT_LOADGEN_PRIORITY)) if rt else ()),
    ]
    # A sidecar's own measure of its added time over the run (cachewitness_added_seconds), read
    # outside the window whose CPU counts.
    own = path.startswith("cw")
    before = added_buckets(service.url) if own else None
    busy0, ours0, sim0 = machine_busy_seconds(), cpu_seconds(ours), cpu_seconds(sim_pids)
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    clock0 = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=seconds + 120)
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        # One disturbed run must not lose the others: kept as failed, left out of the figures.
        stderr = getattr(exc, "stderr", "") or ""
        print(f"  {path}: run failed: {str(exc)[:200]} {stderr[-300:]}", file=sys.stderr, flush=True)
        result = {"failed": f"{exc} {stderr[-1500:]}"}
    wall = time.perf_counter() - clock0
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    loadgen = kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime
    mine = cpu_seconds(ours) - ours0 + loadgen
    result.update(
        wall_s=wall,
        sim_cpu_s=cpu_seconds(sim_pids) - sim0,
        loadgen_cpu_s=loadgen,
        # Cores other people's processes kept busy meanwhile: the noise in this run.
        foreign_cores=max(0.0, (machine_busy_seconds() - busy0 - mine) / wall),
    )
    if own:
        result.update(run_quantiles(before, added_buckets(service.url)))
    return result


def _progress(run: dict[str, Any]) -> None:
    """One line per run, so a long bench shows it is alive."""
    head = f"  r{run['round']} {run['case']:7s} {run['path']:8s}"
    if "failed" in run:
        print(f"{head} FAILED", flush=True)
        return
    if run["mode"] == "streams":
        count, what = run["events"], "event"
        latency = f"ttfe p50 {run['ttfe_p50_ms']:.2f} ms (engine {_ms(run.get('baseline_ttfe_p50_ms'))})"
    else:
        count, what = run["requests"], "request"
        latency = (
            f"p50 {run['p50_ms']:.2f} ms (engine {_ms(run.get('baseline_p50_ms'))}), queued {run['queued']}"
        )
    per = 1e6 * run["proxy_cpu_s"] / count if count else 0.0
    print(
        f"{head} {per:7.1f} µs/{what}  {latency}  foreign {run['foreign_cores']:.2f} cores"
        + (f"  ({run['errors']} errors)" if run["errors"] else ""),
        flush=True,
    )


def _ms(value: float | None) -> str:
    """A latency for the progress line."""
    return "—" if value is None else f"{value:.2f} ms"


if __name__ == "__main__":
    raise SystemExit(main())
