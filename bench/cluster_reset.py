"""Wall time of a cluster reset (POST /cache/reset?scope=cluster) over 3 and 10 local sidecars, against one pod's reset.

Each pod is two processes, as in Kubernetes: a vLLM simulator (`cachewitness sim`) and a
sidecar (`cachewitness serve`) with a static `peers` list naming every sidecar. The client
calls one sidecar; the times are the client's, request sent to answer read. The engines are
idle, so the time is the sidecars' own: the fan-out, each pod's drain check, engine calls and
evidence record, and the answer — with `verify=none` (the reset alone) and with the default
canary (each pod proves its reset: a private prompt cached before, cold after, which adds
requests and resets). A last row times the peers_dns lookup alone (a dnslib server on
loopback, a fresh c-ares channel per call, as every cluster call does).

    .venv/bin/python bench/cluster_reset.py [--rounds 30] [--sizes 3,10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Service, free_port, start_service

from proxy.cluster.peers import discover_peers
from proxy.config import Settings

PY = sys.executable
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def post(url: str) -> dict[str, object]:
    """POST an empty body; the JSON answer."""
    request = urllib.request.Request(url, data=b"", method="POST")
    with _NO_PROXY.open(request, timeout=120) as response:
        answer: dict[str, object] = json.loads(response.read())
        return answer


def resets_total(sim_url: str) -> int:
    """The simulator's own count of resets."""
    with _NO_PROXY.open(f"{sim_url}/sim/stats", timeout=10) as response:
        return int(json.loads(response.read())["resets_total"])


def start_pods(n: int, work: Path) -> tuple[list[Service], list[Service]]:
    """n simulators and n sidecars, every sidecar knowing all n."""
    sim_ports = [free_port() for _ in range(n)]
    car_ports = [free_port() for _ in range(n)]
    peers = ",".join(f"127.0.0.1:{port}" for port in car_ports)
    sims = [
        start_service(
            f"sim{n}-{i}",
            [PY, "-m", "proxy", "sim", "--dialect", "vllm", "--listen", f"127.0.0.1:{port}",
             "--decode-rate", "0", "--prefill-rate", "0"],
            f"http://127.0.0.1:{port}",
            work,
            "/health",
        )
        for i, port in enumerate(sim_ports)
    ]  # fmt: skip
    cars = [
        start_service(
            f"sidecar{n}-{i}",
            [PY, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{sim_port}",
             "--listen", f"127.0.0.1:{port}", "--evidence", str(work / f"ev{n}-{i}.jsonl"),
             "--peers", peers, "--log-level", "warning"],
            f"http://127.0.0.1:{port}",
            work,
            "/-/ready",
        )
        for i, (sim_port, port) in enumerate(zip(sim_ports, car_ports, strict=True))
    ]  # fmt: skip
    return sims, cars


def timed(urls: list[str], rounds: int, want: str) -> list[list[float]]:
    """Milliseconds of `rounds` resets at each of `urls`, alternating (one of each per round, so
    load from other processes falls on all alike), after one warm-up each; each must answer `want`."""
    for url in urls:
        post(url)
    times: list[list[float]] = [[] for _ in urls]
    for _ in range(rounds):
        for url, series in zip(urls, times, strict=True):
            started = time.perf_counter()
            answer = post(url)
            series.append((time.perf_counter() - started) * 1000)
            if answer.get("answer") != want:
                sys.exit(f"bench: {url} answered {answer.get('answer')}, not {want}: {answer}")
    return times


async def dns_lookup_ms(rounds: int, n: int) -> list[float]:
    """Milliseconds of `discover_peers` against a dnslib server answering n A records."""
    from tests.support.dns_server import dns_server

    async with dns_server() as server:
        server.set("cw-peers.bench.test", [f"127.0.0.{i + 1}" for i in range(n)])
        settings = Settings(peers_dns="cw-peers.bench.test:9000", peers_dns_server=server.address)
        times: list[float] = []
        for _ in range(rounds + 1):
            started = time.perf_counter()
            found = await discover_peers(settings)
            times.append((time.perf_counter() - started) * 1000)
            assert len(found.peers) == n, found
        return times[1:]


def row(what: str, pods: int, times: list[float]) -> str:
    """One table row: median, p90, min, max in ms."""
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return (
        f"| {what} | {pods} | {statistics.median(ordered):.1f} | {p90:.1f} | "
        f"{ordered[0]:.1f} | {ordered[-1]:.1f} |"
    )


def main() -> int:
    """Start the pods for each size, time the resets, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", default="3,10", help="comma-separated pod counts")
    ns = parser.parse_args()
    sizes = [int(s) for s in ns.sizes.split(",")]
    rows = ["| reset | pods | median ms | p90 ms | min ms | max ms |", "|---|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="cw-cluster-bench-") as tmp:
        work = Path(tmp)
        for n in sizes:
            sims, cars = start_pods(n, work)
            try:
                base = f"{cars[0].url}/cache/reset"
                kinds = [
                    ("one pod, `verify=none`", 1, f"{base}?verify=none"),
                    ("cluster, `verify=none`", n, f"{base}?scope=cluster&verify=none"),
                    ("one pod, canary (default)", 1, base),
                    ("cluster, canary (default)", n, f"{base}?scope=cluster"),
                ]
                times = timed([url for _, _, url in kinds], ns.rounds, "acknowledged")
                counts = [resets_total(s.url) for s in sims]
                # Pod 0 took every pod reset and its share of every cluster one, the others only the
                # latter: twice as many engine resets there, the same number on every other pod.
                if any(count != counts[-1] for count in counts[1:]) or counts[0] != 2 * counts[-1]:
                    sys.exit(f"bench: the engines counted {counts} resets: not every pod was reset")
                rows += [
                    row(what, pods, series) for (what, pods, _), series in zip(kinds, times, strict=True)
                ]
            finally:
                for service in cars + sims:
                    service.stop()
        for n in sizes:
            rows.append(
                row(
                    "peers_dns lookup alone (dnslib on loopback)", n, asyncio.run(dns_lookup_ms(ns.rounds, n))
                )
            )
    print("\n".join(rows))
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(
        f"\n{ns.rounds} rounds after one warm-up, the four kinds of reset alternating; "
        f"load average at the end {', '.join(load)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
