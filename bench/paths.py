"""The paths `make bench` compares: the services started for them, and a case measured against each.

Direct to the simulator, cachewitness with evidence and injection on, cachewitness bare and
nginx, each in front of the same simulator; a slow simulator behind a second port of each proxy
holds 1,000 streams open for the memory figure.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

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
    start_simulator,
)
from loads import WRK_SCRIPT
from nginx_conf import start_nginx

__all__ = ["BARE", "Bench", "Snapshot", "start_sidecar"]

HERE = Path(__file__).resolve().parent
OPEN_STREAMS = 1000
# The bare sidecar: a plain streaming proxy.
BARE = ["--no-observe", "--no-inject-usage"]


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


@dataclass(frozen=True)
class Snapshot:
    """Counters at one instant: a measurement is the difference of two."""

    clock: float  # perf_counter seconds
    proxy_user: float  # CPU seconds of the proxy under test (none for the direct path)
    proxy_system: float
    proxy_reads: int  # its read-type system calls
    upstream_cpu: float  # CPU seconds of the simulator
    loadgen_cpu: float  # CPU seconds of finished children: the load generators
    ours_cpu: float  # CPU seconds of every service we started
    core_busy: dict[str, float]  # busy seconds per core, everyone's


def start_sidecar(
    name: str,
    upstream: str,
    extra: list[str],
    core: str | None,
    work: Path,
    cwd: Path | None = None,
    python: str = sys.executable,
    entry: Sequence[str] | None = None,
    wrapper: Sequence[str] = (),
) -> Service:
    """A cachewitness sidecar in front of `upstream`, pinned to `core`, its evidence and log in `work`
    (`cwd`: the checkout whose `proxy/` runs, for `python -m`; None: this one; `python`: the
    interpreter, whose environment must hold the project's dependencies; `entry`: what runs
    `cachewitness` with the arguments after it, bench/stage_timer.py for one; None: `-m proxy`;
    `wrapper`: what runs the interpreter, valgrind for bench/instructions.py)."""
    port = free_port()
    return start_service(
        name,
        [
            *Cores.prefix(core),
            *wrapper,
            python,
            *(("-m", "proxy") if entry is None else entry),
            *("serve", "--upstream", upstream, "--listen", f"127.0.0.1:{port}"),
            *("--evidence", str(work / f"{name}.jsonl"), "--log-level", "warning", *extra),
        ],
        f"http://127.0.0.1:{port}",
        work,
        "/-/ready",
        cwd,
    )


class Bench:
    """The running services and how to measure a case against each path."""

    def __init__(self, tmp: Path, pin: bool) -> None:
        """Install the tools if needed and start everything."""
        self.tmp = tmp
        self.nginx_bin, self.wrk = ensure_tools()
        self.cores = Cores.choose(pin)
        self.script = tmp / "post.lua"
        self.script.write_text(WRK_SCRIPT)
        self.services: dict[str, Service] = {}
        self.services["sim"] = start_simulator(self.cores.rest, tmp)
        # Open streams need an engine that is still generating: 1 token/s (memory case only).
        self.services["slow-sim"] = start_simulator(self.cores.rest, tmp, decode_rate=1, name="slow-sim")
        sim, slow = self.services["sim"].url, self.services["slow-sim"].url
        for name, extra in (("cw", []), ("cw-bare", BARE)):
            self.services[name] = self._start_sidecar(name, sim, extra)
        self.services["nginx"], (_, self.nginx_slow_url) = start_nginx(
            self.nginx_bin, self.cores.proxy, tmp, [sim, slow]
        )
        self.services["direct"] = self.services["sim"]
        self.idle_rss = {name: rss_mb(self.services[name].pids()) for name in ("cw", "cw-bare", "nginx")}

    def url(self, path: str) -> str:
        """Base URL the load generator targets for a path."""
        return self.services[path].url

    def measure(self, path: str, run: Callable[[], dict[str, float]]) -> dict[str, object]:
        """Run one load against one path; add CPU of proxy, upstream, load generator and the machine."""
        before = self._snapshot(path)
        result: dict[str, object]
        try:
            result = dict(run())
        except (RuntimeError, ValueError, subprocess.SubprocessError, OSError) as exc:
            # One disturbed run (a stalled machine, a timeout) must not lose the others: keep it as failed.
            print(f"  {path}: run failed: {str(exc)[:300]}", file=sys.stderr, flush=True)
            result = {"failed": str(exc)[:2000], "errors": 1.0}
        after = self._snapshot(path)
        wall = after.clock - before.clock
        loadgen = after.loadgen_cpu - before.loadgen_cpu
        cores = {c: (after.core_busy[c] - before.core_busy.get(c, 0.0)) / wall for c in after.core_busy}
        proxy_cpu = after.proxy_user + after.proxy_system - before.proxy_user - before.proxy_system
        upstream_cpu = after.upstream_cpu - before.upstream_cpu
        core_busy = {c: round(v, 3) for c, v in cores.items()}
        result.update(
            wall_s=wall,
            proxy_cpu_s=proxy_cpu,
            # The user/kernel split and the reads show how much of the proxy's CPU is the
            # kernel's, and how many events each read from the engine (and write) carried.
            proxy_user_s=after.proxy_user - before.proxy_user,
            proxy_system_s=after.proxy_system - before.proxy_system,
            proxy_reads=after.proxy_reads - before.proxy_reads,
            upstream_cpu_s=upstream_cpu,
            loadgen_cpu_s=loadgen,
            foreign_cores=max(0.0, sum(cores.values()) - (after.ours_cpu - before.ours_cpu + loadgen) / wall),
            core_busy=core_busy,
        )
        result["bottleneck"] = self._bottleneck(path, wall, proxy_cpu, upstream_cpu + loadgen, core_busy)
        return result

    def _snapshot(self, path: str) -> Snapshot:
        """The counters `measure` takes the difference of, now."""
        proxy = self.services[path].pids() if path != "direct" else []
        ours = sorted({p for s in self.services.values() for p in s.pids()})
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        user, system = cpu_split(proxy)
        return Snapshot(
            clock=time.perf_counter(),
            proxy_user=user,
            proxy_system=system,
            proxy_reads=read_calls(proxy),
            upstream_cpu=cpu_seconds(self.services["sim"].pids()),
            loadgen_cpu=children.ru_utime + children.ru_stime,
            ours_cpu=cpu_seconds(ours),
            core_busy=_per_core_busy(),
        )

    def _bottleneck(
        self, path: str, wall: float, proxy_cpu: float, rest_cpu: float, busy: dict[str, float]
    ) -> str:
        """Which side ran out of CPU during this run (CPU seconds over `wall`; busy: per core), in words."""
        proxy_u = proxy_cpu / wall
        rest_u = rest_cpu / wall
        found = []
        if self.cores.proxy is None:
            if sum(busy.values()) >= 0.9 * len(busy):
                found.append(f"machine full (proxy {proxy_u:.0%}, sim+loadgen {rest_u:.0%})")
        else:
            if path != "direct" and busy.get(self.cores.proxy, 0.0) >= 0.9:
                found.append(f"proxy core full (proxy {proxy_u:.0%})")
            if self.cores.rest is not None and busy.get(self.cores.rest, 0.0) >= 0.9:
                found.append(f"loadgen+sim core full ({rest_u:.0%} theirs)")
        return "; ".join(found) or "no core full (latency-bound)"

    def open_streams_rss(self, path: str) -> dict[str, float]:
        """RSS of a proxy with OPEN_STREAMS streams open through it (the slow simulator behind it)."""
        if path == "nginx":
            service, url = self.services["nginx"], self.nginx_slow_url
        else:
            extra = BARE if path == "cw-bare" else []
            service = self._start_sidecar(f"{path}-mem", self.services["slow-sim"].url, extra)
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

    def _start_sidecar(self, name: str, upstream: str, extra: list[str]) -> Service:
        """A cachewitness sidecar in front of `upstream`, pinned to the proxy's core."""
        return start_sidecar(name, upstream, extra, self.cores.proxy, self.tmp)

    def stop(self) -> None:
        """Stop every service."""
        for name, service in self.services.items():
            if name != "direct":
                service.stop()
