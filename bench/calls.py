"""Which code runs per request: the sidecar's Python function calls per request at a paced load.

    .venv/bin/python bench/calls.py [--rate 400] [--seconds 5] [--top 25] [--stream] [--keep DIR]

Starts the vLLM simulator (100 tokens/s) and the sidecar twice, with its defaults and bare
(`--no-observe --no-inject-usage`), each under cProfile switched on only for the measured
window (SIGUSR1 on, SIGUSR2 off and written), and runs the paced bench's request case
(bench/paced_load.py: `--rate` requests/s over 48 keep-alive connections, 8 tokens each;
`--stream`: the same requests streamed). Prints the calls per request (Python functions and
the C functions they call) and the functions called most per request.

A count, not a time: it does not move with the machine's load, as the CPU figures of a paced
load do (about ±4 % between A/B rounds here). At a paced load a request's CPU is mostly
cache misses of code and data that ran cold since the last request (bench/README.md, issue
34): the code a request runs is what that cost scales with, and this is its measure.
cProfile's times are not shown: it makes every call several times dearer. `--keep DIR` leaves the
two profiles there (`calls-defaults.prof`, `calls-bare.prof`) for pstats' callers and callees.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/profile.py (py-spy) shadows the standard library's `profile`, which cProfile imports:
# both are taken before this folder goes first on the path.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
import cProfile
import pstats

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Cores, free_port, start_service, start_simulator
from paths import BARE

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def serve_profiled(out: Path, argv: list[str]) -> int:
    """Run `cachewitness serve` with cProfile on between SIGUSR1 and SIGUSR2 (then written to `out`)."""
    sys.path.insert(0, str(ROOT))
    from proxy.cli import main  # this process is the sidecar: its imports are its own

    profile = cProfile.Profile()

    def on(signum: int, frame: object) -> None:
        profile.enable()

    def off(signum: int, frame: object) -> None:
        profile.disable()
        profile.dump_stats(out)

    signal.signal(signal.SIGUSR1, on)
    signal.signal(signal.SIGUSR2, off)
    return main(argv)


def measure(ns: argparse.Namespace, cores: Cores, work: Path, sim_url: str, extra: list[str]) -> pstats.Stats:
    """One sidecar under cProfile, the load run over it: the window's statistics."""
    port, out = free_port(), work / f"calls-{'bare' if extra else 'defaults'}.prof"
    sidecar = start_service(
        "sidecar",
        [
            *Cores.prefix(cores.proxy),
            *(sys.executable, str(Path(__file__).resolve()), "--serve-profiled", str(out)),
            *("serve", "--upstream", sim_url, "--listen", f"127.0.0.1:{port}"),
            *("--evidence", str(work / "evidence.jsonl"), "--log-level", "warning", *extra),
        ],
        f"http://127.0.0.1:{port}",
        work,
        "/-/ready",
        ROOT,
    )
    try:
        _load(ns, cores, sidecar.url, 1.0)  # warm-up: connections open, first-use paths taken
        sidecar.proc.send_signal(signal.SIGUSR1)
        time.sleep(0.2)
        requests = _load(ns, cores, sidecar.url, ns.seconds)
        sidecar.proc.send_signal(signal.SIGUSR2)
        for _ in range(100):
            if out.exists() and out.stat().st_size:
                break
            time.sleep(0.05)
        time.sleep(0.2)  # the dump is written whole before the next read
    finally:
        sidecar.stop()
    stats = pstats.Stats(str(out))
    stats.requests = requests  # type: ignore[attr-defined]
    return stats


def _load(ns: argparse.Namespace, cores: Cores, url: str, seconds: float) -> int:
    """The paced request case for `seconds`: how many requests were answered."""
    command = [
        *Cores.prefix(cores.rest),
        *(sys.executable, str(HERE / "paced_load.py"), "streams" if ns.stream else "requests"),
        *(("--streams", "48") if ns.stream else ("--rate", f"{ns.rate:g}", "--connections", "48")),
        *("--max-tokens", "8", "--url", url, "--seconds", f"{seconds:g}"),
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=seconds + 120).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return int(result["stream_requests"] if ns.stream else result["requests"])


def _name(key: tuple[str, int, str]) -> str:
    """`function (file)`, the file from its package on."""
    path, _, function = key
    for marker in ("site-packages/", str(ROOT) + "/", "python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{function} ({path})" if path != "~" else function


def table(results: dict[str, pstats.Stats], top: int) -> str:
    """Calls per request for each variant, then the functions called most per request."""
    per: dict[str, dict[str, float]] = {}
    for variant, stats in results.items():
        requests = max(1, stats.requests)  # type: ignore[attr-defined]
        per[variant] = {_name(key): row[1] / requests for key, row in stats.stats.items()}  # type: ignore[attr-defined]
    lines = ["| sidecar | calls per request | Python functions among them |", "|---|---:|---:|"]
    for variant, counts in per.items():
        python = sum(n for name, n in counts.items() if "(" in name)
        lines.append(f"| {variant} | {sum(counts.values()):.0f} | {python:.0f} |")
    first = next(iter(per))
    lines += ["", "Calls per request, by function, the most called first:", ""]
    lines += [f"| {' | '.join(per)} | function |", "|" + "---:|" * len(per) + "---|"]
    ranked = sorted(per[first].items(), key=lambda item: -item[1])[:top]
    for name, _ in ranked:
        figures = " | ".join(f"{per[variant].get(name, 0.0):.2f}" for variant in per)
        lines.append(f"| {figures} | `{name}` |")
    return "\n".join(lines)


def main() -> int:
    """Measure both variants and print the tables."""
    if sys.argv[1:2] == ["--serve-profiled"]:
        return serve_profiled(Path(sys.argv[2]), sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=400.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--stream", action="store_true", help="streamed requests (48 connections, back to back)"
    )
    parser.add_argument("--keep", type=Path, help="a folder to leave the two profiles in")
    ns = parser.parse_args()
    cores = Cores.choose(pin=True)
    results: dict[str, pstats.Stats] = {}
    with tempfile.TemporaryDirectory(prefix="cw-calls-") as tmp:
        work = ns.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        sim = start_simulator(cores.rest, work, decode_rate=100)
        try:
            for variant, extra in (("defaults", []), ("bare", BARE)):
                results[variant] = measure(ns, cores, work, sim.url, extra)
        finally:
            sim.stop()
    kind = (
        "streamed, 48 connections back to back"
        if ns.stream
        else f"{ns.rate:g} requests/s over 48 connections"
    )
    print(
        f"Python calls per request, {kind}, 8 tokens, {ns.seconds:g} s under cProfile (commit {_commit()})\n"
    )
    print(table(results, ns.top))
    return 0


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    raise SystemExit(main())
