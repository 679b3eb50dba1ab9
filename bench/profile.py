"""Where the sidecar's CPU goes per request: py-spy on one sidecar under wrk's load, as tables.

    .venv/bin/pip install -e '.[bench]'      # py-spy, pinned in pyproject's bench extra
    .venv/bin/python bench/profile.py [--seconds 8] [--concurrency 16] [--bare] [--top 25]

Starts the vLLM simulator (decode/prefill rate 0) and one sidecar (defaults: evidence and
injection on; `--bare`: `--no-observe --no-inject-usage`), each pinned as in `make bench`,
drives the sidecar with wrk (small non-streaming chat completions) and samples it with
`py-spy record --format raw` meanwhile. Prints the sidecar's CPU µs per request over the
run, then the functions with the largest inclusive and self shares of the samples, with
the µs per request each share stands for. `--raw FILE` keeps py-spy's collapsed stacks
(feed them to a flame graph tool).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Cores, cpu_seconds, ensure_tools, free_port, start_service, start_simulator
from loads import WRK_SCRIPT, run_wrk

_IDLE = ("epoll", "select", "_run_once (asyncio", "poll (selectors")


def _frames(stack: str) -> list[str]:
    """One collapsed stack (`a;b;c`) as frames, outermost first, in `function (file)` form."""
    frames = []
    for frame in stack.split(";"):
        name, _, where = frame.partition(" (")
        path = where.rsplit(":", 1)[0].rstrip(")")
        frames.append(f"{name} ({_short(path)})")
    return frames


def _short(path: str) -> str:
    """A source path from its package on (`aiohttp/client.py`, `proxy/forward.py`)."""
    for marker in ("site-packages/", "/proxy/", "python3."):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return ("proxy/" + tail) if marker == "/proxy/" else tail.split("/", 1)[-1]
    return path


def summarize(raw: str, top: int, us_per_request: float) -> str:
    """Inclusive and self tables from py-spy's raw (collapsed) output."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = _frames(stack)
        if frames and any(mark in frames[-1] for mark in _IDLE):
            continue  # waiting for the next event is not work done for a request
        total += count
        for frame in set(frames):
            inclusive[frame] += count
        if frames:
            own[frames[-1]] += count
    if not total:
        return "no busy samples"
    lines = [f"{total} busy samples; a share of 100 % is {us_per_request:.0f} µs per request", ""]
    for title, counter in (("inclusive", inclusive), ("self", own)):
        lines += [f"| {title} share | µs/request | function |", "|---:|---:|---|"]
        for frame, count in counter.most_common(top):
            share = count / total
            lines.append(f"| {share * 100:.1f} % | {share * us_per_request:.0f} | `{frame}` |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    """Run the load, sample the sidecar, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--bare", action="store_true", help="--no-observe --no-inject-usage")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    parser.add_argument("--raw", type=Path, help="also keep py-spy's collapsed stacks here")
    ns = parser.parse_args()
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        sys.exit("bench/profile.py needs py-spy: .venv/bin/pip install -e '.[bench]'")
    _, wrk = ensure_tools()
    cores = Cores.choose(pin=True)
    with tempfile.TemporaryDirectory(prefix="cw-profile-") as tmp:
        work = Path(tmp)
        script = work / "post.lua"
        script.write_text(WRK_SCRIPT)
        listen = free_port()
        sim = start_simulator(cores.rest, work)
        sidecar = start_service(
            "sidecar",
            [
                *Cores.prefix(cores.proxy),
                sys.executable,
                *("-m", "proxy", "serve", "--upstream", sim.url, "--listen", f"127.0.0.1:{listen}"),
                *("--evidence", str(work / "evidence.jsonl"), "--log-level", "warning"),
                *(["--no-observe", "--no-inject-usage"] if ns.bare else []),
            ],
            f"http://127.0.0.1:{listen}",
            work,
            "/-/ready",
        )
        raw_path = work / "profile.txt"
        try:
            run_wrk(wrk, Cores.prefix(cores.rest), script, sidecar.url, ns.concurrency, 1)  # warm-up
            spy = subprocess.Popen(
                [
                    *(py_spy, "record", "--pid", str(sidecar.proc.pid), "--duration", str(round(ns.seconds))),
                    *("--rate", str(ns.rate), "--format", "raw", "--output", str(raw_path), "--nonblocking"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            before = cpu_seconds(sidecar.pids())
            result = run_wrk(wrk, Cores.prefix(cores.rest), script, sidecar.url, ns.concurrency, ns.seconds)
            spent = cpu_seconds(sidecar.pids()) - before
            spy.wait(timeout=ns.seconds + 60)
        finally:
            sidecar.stop()
            sim.stop()
        raw = raw_path.read_text() if raw_path.exists() else ""
        if ns.raw is not None:
            ns.raw.write_text(raw)
    us = 1e6 * spent / max(1.0, result["requests"])
    kind = "bare" if ns.bare else "evidence + injection on"
    print(
        f"sidecar ({kind}), wrk c={ns.concurrency} for {ns.seconds:g} s: {result['rps']:.0f} req/s, "
        f"CPU {us:.0f} µs per request (py-spy --nonblocking at {ns.rate} Hz adds a little)\n"
    )
    print(summarize(raw, ns.top, us))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
