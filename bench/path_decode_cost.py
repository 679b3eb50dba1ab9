"""What judging a request path costs, and what a client spraying deeply encoded paths does to others.

    .venv/bin/python bench/path_decode_cost.py [--seconds 4] [--attackers 4] [--against DIR]

Part 1 (CPU, one process): µs per call of the route policy's path normalisation for a few
path shapes, this checkout's (two decoding passes at most, then refused) beside the loop it
replaced (decode until nothing changes, as before issue 27, copied here as the reference).

Part 2 (end to end): `python -m proxy serve` before the simulator; the latency of plain
`GET /v1/models` requests alone and while `--attackers` loops send 8 KB `/%2525...2541/N`
paths (N unique). `--against DIR` runs the same against a sidecar started from another checkout's code
(e.g. main before the fix). Figures are medians and p99 over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import timeit
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote

import aiohttp
from yarl import URL

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Service, free_port, start_service, start_simulator

from proxy.admin.policy import normalise_path

# `/%2525...2541`, 8 KB (aiohttp takes request lines up to 8,190 bytes): each decoding pass
# turns the leading `%25` into `%`, so the path shrinks by two bytes a pass, 4,081 passes.
DEEP = "/%" + "25" * 4080 + "41"


def _deep(n: int) -> str:
    """The deep path made unique (the route policy remembers the decisions it made for plain traffic)."""
    return "/%" + "25" * 4074 + f"41/{n:010d}"


SHAPES = {
    "/v1/chat/completions": "/v1/chat/completions",
    "/%72eset_prefix_cache (once)": "/%72eset_prefix_cache",
    "/%2572eset_prefix_cache (twice)": "/%2572eset_prefix_cache",
    "8 KB of %41 (long, once)": "/" + "%41" * 2720,
    "8 KB /%2525...41 (4,081 deep)": DEEP,
}


def _before(raw_path: str) -> str:
    """The normalisation before issue 27: percent-decode until nothing changes (segments as now)."""
    path = raw_path.split("?", 1)[0].split("#", 1)[0]
    while (decoded := unquote(path, errors="replace")) != path:
        path = decoded
    segments: list[str] = []
    for segment in path.replace("\\", "/").split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return ("/" + "/".join(segments)).lower()


def _per_call_us(fn: Callable[[str], object], path: str) -> float:
    """Best of 5 timings, in µs per call."""
    timer = timeit.Timer(lambda: fn(path))
    number, _ = timer.autorange()
    return min(timer.repeat(5, number)) / number * 1e6


def cpu_table() -> None:
    """Part 1: µs per path judged, before and now."""
    print("| path | before: µs | now: µs | now decides |")
    print("|---|---:|---:|---|")
    for name, path in SHAPES.items():
        now = normalise_path(path)
        verdict = "refused (400)" if now is None else f"`{now[:32]}`"
        print(
            f"| {name} | {_per_call_us(_before, path):,.1f} | {_per_call_us(normalise_path, path):,.1f} | {verdict} |"
        )


async def _attack(url: str, seconds: float, attackers: int) -> int:
    """`attackers` loops sending the deep path for `seconds`; how many were sent."""
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + seconds + 1  # outlasts the measurement, which starts once "ready" is read
    sent = 0

    async def one(http: aiohttp.ClientSession) -> None:
        nonlocal sent
        while loop.time() < stop_at:
            async with http.get(URL(url + _deep(sent), encoded=True)) as resp:
                await resp.read()
            sent += 1

    async with aiohttp.ClientSession() as http:
        print("ready", flush=True)
        await asyncio.gather(*(one(http) for _ in range(attackers)))
    return sent


async def _latencies(url: str, seconds: float, attackers: int) -> tuple[list[float], int]:
    """Plain requests' latencies (ms) for `seconds`, while another process runs the attack loops."""
    attack = None
    if attackers:
        # Its own process: the attackers' client work must not slow the measuring client.
        attack = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--attack", url, "--seconds", str(seconds),
            "--attackers", str(attackers), stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert attack.stdout is not None
        await asyncio.wait_for(attack.stdout.readline(), timeout=30)
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + seconds
    latencies: list[float] = []
    async with aiohttp.ClientSession() as http:
        while loop.time() < stop_at:
            started = loop.time()
            async with http.get(url + "/v1/models") as resp:
                await resp.read()
            latencies.append((loop.time() - started) * 1000)
    if attack is None:
        return latencies, 0
    out, _ = await asyncio.wait_for(attack.communicate(), timeout=seconds + 30)
    return latencies, int(out.decode().split()[-1])


def _sidecar(name: str, sim: Service, work: Path, checkout: Path | None) -> Service:
    """`python -m proxy serve` before the simulator, from this checkout or `checkout`."""
    port = free_port()
    where = ["sh", "-c", f'cd "{checkout}" && exec "$0" "$@"'] if checkout is not None else []
    argv = [*where, sys.executable, "-m", "proxy", "serve", "--upstream", sim.url]
    argv += ["--listen", f"127.0.0.1:{port}", "--evidence", str(work / f"{name}.jsonl"), "--engine", "vllm"]
    return start_service(name, argv, f"http://127.0.0.1:{port}", work, "/-/ready")


def latency_table(seconds: float, attackers: int, against: Path | None) -> None:
    """Part 2: plain-request latency alone and under the deep-path loops."""
    print("\n| sidecar | attackers | plain p50 ms | plain p99 ms | plain requests | deep paths sent |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="cw-path-cost-") as tmp:
        work = Path(tmp)
        sim = start_simulator(None, work)
        runs = [("this checkout", None)] + ([(str(against), against)] if against is not None else [])
        try:
            for index, (label, checkout) in enumerate(runs):
                sidecar = _sidecar(f"sidecar{index}", sim, work, checkout)
                try:
                    for n in (0, attackers):
                        latencies, sent = asyncio.run(_latencies(sidecar.url, seconds, n))
                        p99 = sorted(latencies)[int(0.99 * (len(latencies) - 1))]
                        print(
                            f"| {label} | {n} | {statistics.median(latencies):.2f} | {p99:.2f} "
                            f"| {len(latencies):,} | {sent:,} |"
                        )
                finally:
                    sidecar.stop()
        finally:
            sim.stop()


def main() -> int:
    """Print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--attackers", type=int, default=4)
    parser.add_argument("--against", type=Path, help="another checkout: its sidecar runs too")
    parser.add_argument("--attack", metavar="URL", help=argparse.SUPPRESS)  # the attackers' own process
    ns = parser.parse_args()
    if ns.attack:
        print(asyncio.run(_attack(ns.attack, ns.seconds, ns.attackers)))
        return 0
    cpu_table()
    latency_table(ns.seconds, ns.attackers, ns.against.resolve() if ns.against else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
