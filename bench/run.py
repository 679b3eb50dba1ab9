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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    Cores,
    Service,
    cpu_seconds,
    cpu_split,
    ensure_tools,
    free_port,
    read_calls,
    rss_mb,
    start_service,
)
from loads import WRK_SCRIPT, run_sse, run_wrk
from nginx_conf import nginx_config
from report import render

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PATHS = ("direct", "cw", "cw-bare", "nginx")
NONSTREAM_CONCURRENCY = (1, 16, 64)
STREAM_CONCURRENCY = (64, 256)
STREAM_TOKENS = 256
OPEN_STREAMS = 1000


def _per_core_busy() -> dict[str, float]:
    """Busy CPU seconds so far per core (`cpu0`, `cpu1`, ...)."""
    busy: dict[str, float] = {}
    tck = os.sysconf("SC_CLK_TCK")
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *values = line.split()
            v = [int(x) for x in values]
            busy[name[3:]] = (sum(v[:8]) - v[3] - v[4]) / tck
    return busy


class Bench:
    """The running services and how to measure a case against each path."""

    def __init__(self, tmp: Path, pin: bool) -> None:
        """Install the tools if needed and start everything."""
        self.tmp = tmp
        self.nginx_bin, self.wrk = ensure_tools()
        self.cores = Cores.choose(pin)
        self.script = tmp / "post.lua"
        self.script.write_text(WRK_SCRIPT)
        py = [sys.executable]
        proxy_pin, rest_pin = Cores.prefix(self.cores.proxy), Cores.prefix(self.cores.rest)
        self.services: dict[str, Service] = {}
        sim_port, slow_port = free_port(), free_port()
        self.services["sim"] = start_service(
            "sim",
            [
                *rest_pin,
                *py,
                "-m",
                "proxy",
                "sim",
                "--dialect",
                "vllm",
                "--listen",
                f"127.0.0.1:{sim_port}",
                "--decode-rate",
                "0",
                "--prefill-rate",
                "0",
            ],
            f"http://127.0.0.1:{sim_port}",
            tmp,
            "/health",
        )
        # Open streams need an engine that is still generating: 1 token/s (memory case only).
        self.services["slow-sim"] = start_service(
            "slow-sim",
            [
                *rest_pin,
                *py,
                "-m",
                "proxy",
                "sim",
                "--dialect",
                "vllm",
                "--listen",
                f"127.0.0.1:{slow_port}",
                "--decode-rate",
                "1",
                "--prefill-rate",
                "0",
            ],
            f"http://127.0.0.1:{slow_port}",
            tmp,
            "/health",
        )
        for name, upstream, extra in (
            ("cw", sim_port, []),
            ("cw-bare", sim_port, ["--no-observe", "--no-inject-usage"]),
        ):
            port = free_port()
            self.services[name] = start_service(
                name,
                [
                    *proxy_pin,
                    *py,
                    "-m",
                    "proxy",
                    "serve",
                    "--upstream",
                    f"http://127.0.0.1:{upstream}",
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--evidence",
                    str(tmp / f"{name}.jsonl"),
                    "--log-level",
                    "warning",
                    *extra,
                ],
                f"http://127.0.0.1:{port}",
                tmp,
                "/-/ready",
            )
        nginx_port, nginx_slow_port = free_port(), free_port()
        prefix = tmp / "nginx"
        prefix.mkdir()
        conf = prefix / "nginx.conf"
        conf.write_text(
            nginx_config(
                prefix, [(nginx_port, f"127.0.0.1:{sim_port}"), (nginx_slow_port, f"127.0.0.1:{slow_port}")]
            )
        )
        self.services["nginx"] = start_service(
            "nginx",
            [*proxy_pin, self.nginx_bin, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")],
            f"http://127.0.0.1:{nginx_port}",
            tmp,
            "/health",
        )
        self.nginx_slow_url = f"http://127.0.0.1:{nginx_slow_port}"
        self.services["direct"] = self.services["sim"]
        self.idle_rss = {name: rss_mb(self.services[name].pids()) for name in ("cw", "cw-bare", "nginx")}

    def url(self, path: str) -> str:
        """Base URL the load generator targets for a path."""
        return self.services[path].url

    def measure(self, path: str, run: callable) -> dict[str, float]:  # type: ignore[valid-type]
        """Run one load against one path; add CPU of proxy, upstream, load generator and the machine."""
        proxy = self.services[path] if path != "direct" else None
        sim = self.services["sim"]
        ours = [p for s in self.services.values() for p in s.pids()]
        before = (
            time.perf_counter(),
            cpu_seconds(proxy.pids()) if proxy else 0.0,
            cpu_seconds(sim.pids()),
            resource.getrusage(resource.RUSAGE_CHILDREN),
            cpu_seconds(sorted(set(ours))),
            _per_core_busy(),
            cpu_split(proxy.pids()) if proxy else (0.0, 0.0),
            read_calls(proxy.pids()) if proxy else 0,
        )
        try:
            result = run()
        except (RuntimeError, ValueError, subprocess.SubprocessError, OSError) as exc:
            # One disturbed run (a stalled machine, a timeout) must not lose the others: keep it as failed.
            print(f"  {path}: run failed: {str(exc)[:300]}", file=sys.stderr, flush=True)
            result = {"failed": str(exc)[:2000], "errors": 1.0}
        after = (
            time.perf_counter(),
            cpu_seconds(proxy.pids()) if proxy else 0.0,
            cpu_seconds(sim.pids()),
            resource.getrusage(resource.RUSAGE_CHILDREN),
            cpu_seconds(sorted(set(ours))),
            _per_core_busy(),
            cpu_split(proxy.pids()) if proxy else (0.0, 0.0),
            read_calls(proxy.pids()) if proxy else 0,
        )
        wall = after[0] - before[0]
        loadgen = (after[3].ru_utime + after[3].ru_stime) - (before[3].ru_utime + before[3].ru_stime)
        cores = {c: (after[5][c] - before[5].get(c, 0.0)) / wall for c in after[5]}
        result.update(
            wall_s=wall,
            proxy_cpu_s=after[1] - before[1],
            # The user/kernel split and the reads show how much of the proxy's CPU is the
            # kernel's, and how many events each read from the engine (and write) carried.
            proxy_user_s=after[6][0] - before[6][0],
            proxy_system_s=after[6][1] - before[6][1],
            proxy_reads=after[7] - before[7],
            upstream_cpu_s=after[2] - before[2],
            loadgen_cpu_s=loadgen,
            foreign_cores=max(0.0, sum(cores.values()) - (after[4] - before[4] + loadgen) / wall),
            core_busy={c: round(v, 3) for c, v in cores.items()},
        )
        result["bottleneck"] = self._bottleneck(path, result)
        return result

    def _bottleneck(self, path: str, r: dict[str, object]) -> str:
        """Which side ran out of CPU during this run, in words."""
        wall = float(r["wall_s"])  # type: ignore[arg-type]
        proxy_u = float(r["proxy_cpu_s"]) / wall  # type: ignore[arg-type]
        rest_u = (float(r["upstream_cpu_s"]) + float(r["loadgen_cpu_s"])) / wall  # type: ignore[arg-type]
        busy: dict[str, float] = r["core_busy"]  # type: ignore[assignment]
        found = []
        if self.cores.proxy is None:
            if sum(busy.values()) >= 0.9 * len(busy):
                found.append(f"machine full (proxy {proxy_u:.0%}, sim+loadgen {rest_u:.0%})")
        else:
            if path != "direct" and busy.get(self.cores.proxy, 0.0) >= 0.9:
                found.append(f"proxy core full (proxy {proxy_u:.0%})")
            if busy.get(self.cores.rest, 0.0) >= 0.9:  # type: ignore[arg-type]
                found.append(f"loadgen+sim core full ({rest_u:.0%} theirs)")
        return "; ".join(found) or "no core full (latency-bound)"

    def open_streams_rss(self, path: str) -> dict[str, float]:
        """RSS of a proxy with OPEN_STREAMS streams open through it (the slow simulator behind it)."""
        slow = self.services["slow-sim"].url.rsplit(":", 1)[1]
        if path == "nginx":
            service, url = self.services["nginx"], self.nginx_slow_url
        else:
            port = free_port()
            extra = ["--no-observe", "--no-inject-usage"] if path == "cw-bare" else []
            service = start_service(
                f"{path}-mem",
                [
                    *Cores.prefix(self.cores.proxy),
                    sys.executable,
                    "-m",
                    "proxy",
                    "serve",
                    "--upstream",
                    f"http://127.0.0.1:{slow}",
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--evidence",
                    str(self.tmp / f"{path}-mem.jsonl"),
                    "--log-level",
                    "warning",
                    *extra,
                ],
                f"http://127.0.0.1:{port}",
                self.tmp,
                "/-/ready",
            )
            url = service.url
        try:
            idle = rss_mb(service.pids())
            client = subprocess.Popen(
                [
                    *Cores.prefix(self.cores.rest),
                    sys.executable,
                    str(HERE / "sse_load.py"),
                    "--url",
                    url,
                    "--concurrency",
                    str(OPEN_STREAMS),
                    "--hold",
                    "--max-tokens",
                    "100000",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert client.stdout is not None and client.stdin is not None
            ready = json.loads(client.stdout.readline() or "{}")
            time.sleep(1.0)  # let a couple of tokens flow through every stream
            held = rss_mb(service.pids())
            client.stdin.close()
            client.wait(60)
            return {
                "idle_mb": idle,
                "open_mb": held,
                "open_streams": float(ready.get("ready", 0)),
                "errors": float(ready.get("errors", 0)),
            }
        finally:
            if path != "nginx":
                service.stop()

    def stop(self) -> None:
        """Stop every service."""
        for name, service in self.services.items():
            if name != "direct":
                service.stop()


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
                            lambda path=path, conc=conc: run_wrk(
                                bench.wrk, rest, bench.script, bench.url(path), conc, ns.seconds
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
                            lambda path=path, conc=conc: run_sse(
                                rest, bench.url(path), conc, ns.seconds, STREAM_TOKENS
                            ),
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
