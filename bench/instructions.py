"""The sidecar's machine instructions per request, counted (valgrind's callgrind), not timed.

    .venv/bin/python bench/instructions.py NAME[@PYTHON]=DIR[:FLAGS] ... [--rates 4,16] [--seconds 10] [--pairs 3]
    .venv/bin/python bench/instructions.py base=../before new=. "bare=.:--no-observe --no-inject-usage"

Each VARIANT (as bench/paced_ab.py's: `python -m proxy serve` run in DIR, FLAGS added, on PYTHON)
runs under `valgrind --tool=callgrind`, counting nothing until the load begins, in front of the
vLLM simulator (100 tokens/s). The paced request case (bench/paced_load.py, 8 tokens, 8
connections) runs at the two `--rates` in turn, `--pairs` times, for `--seconds` each, and
callgrind's count is taken after each. A pair's instructions per request are the slope between
its two: what the sidecar does at a fixed rate whatever the traffic (its timers, the engine
watcher) cancels out, what it does per request stays, the writer thread's share of the evidence
included. The median pair is shown: a rare one-off (a file rotated, a discovery) lands in one
pair only.

Why count: a paced load's CPU per request moves ±5-15 % between runs on a shared machine (the
same code measured +50 and +98 µs over bare in two `make bench` runs, issue 50), and calls
(bench/calls.py) weigh a `len()` as much as a JSON parse. The count of user-space instructions
repeats within 0.3 % and weighs each call by its work. It is not the CPU time: it leaves out the
kernel (the system calls, the wake-ups), cache misses and the instructions' speed; under
valgrind OpenSSL runs without the SHA extensions (valgrind does not emulate them), so the
evidence chain's hashing (`libcrypto`) counts several times what the processor runs.

Printed per variant: instructions per request, by shared object (the interpreter, the C
extensions, libc...), and the ratio to the first variant.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from callgrind import by_object, slope
from harness import start_simulator
from paced_ab import Variant
from paths import start_sidecar

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Count:
    """One variant's instructions per request, in all and by shared object."""

    requests: tuple[int, int]  # the median pair's two loads
    per_request: float
    by_object: dict[str, float]
    pairs: tuple[float, ...]  # every pair's instructions per request


def _load(url: str, rate: float, seconds: float) -> int:
    """The paced request case at `rate` for `seconds`: how many requests were answered."""
    command = [
        *(sys.executable, str(HERE / "paced_load.py"), "requests", "--rate", f"{rate:g}"),
        *("--connections", "8", "--max-tokens", "8", "--url", url, "--seconds", f"{seconds:g}"),
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=seconds + 120).stdout
    return int(json.loads(out.strip().splitlines()[-1])["requests"])


def _annotate(path: Path) -> dict[str, int]:
    out = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return by_object(out)


def measure(
    variant: Variant, upstream: str, work: Path, rates: tuple[float, float], seconds: float, pairs: int
) -> Count:
    """One variant under callgrind: the loads in pairs, a count dumped after each; the median pair."""
    out = work / f"{variant.name}.callgrind"
    # --fair-sched: valgrind runs one thread at a time. With its default lock the same defaults
    # sidecar counted ~590k instructions a request in some processes and ~900k in others (the
    # extra in the interpreter and libc, from the process's start: not understood); with the
    # fair queue, three processes in a row agreed within 0.5 %.
    wrapper = (
        *("valgrind", "--tool=callgrind", "--fair-sched=yes", "--instr-atstart=no"),
        f"--callgrind-out-file={out}",
    )
    service = start_sidecar(
        variant.name,
        upstream,
        list(variant.flags),
        None,
        work,
        cwd=variant.directory,
        python=variant.python,
        wrapper=wrapper,
    )
    pid = str(service.proc.pid)

    def control(*args: str) -> None:
        subprocess.run(["callgrind_control", *args, pid], check=True, capture_output=True, timeout=60)

    answered: list[int] = []
    try:
        _load(service.url, rates[0], 3)  # warm-up: connections open, first-use paths taken
        control("--instr=on")
        control("--zero")
        for _ in range(pairs):
            for rate in rates:
                answered.append(_load(service.url, rate, seconds))
                control("--dump")
        control("--instr=off")
    finally:
        service.stop()
    dumps = sorted(work.glob(f"{out.name}.*"), key=lambda path: int(path.suffix[1:]))
    if len(dumps) < 2 * pairs:
        raise RuntimeError(f"callgrind wrote {len(dumps)} dumps for {variant.name}, not {2 * pairs}")
    counts = []
    for index in range(pairs):
        requests = (answered[2 * index], answered[2 * index + 1])
        per = slope(_annotate(dumps[2 * index]), _annotate(dumps[2 * index + 1]), requests)
        counts.append((sum(per.values()), requests, per))
    counts.sort(key=lambda count: count[0])
    total, requests, per = counts[len(counts) // 2]
    return Count(requests, total, per, tuple(count[0] for count in counts))


def table(counts: dict[str, Count], top: int = 6) -> str:
    """Instructions per request, by the objects that count most in the first variant."""
    first = next(iter(counts.values()))
    names = [name for name, _ in sorted(first.by_object.items(), key=lambda kv: -kv[1])[:top]]
    lines = [
        "| variant | instructions per request | ratio | " + " | ".join(names) + " | other |",
        "|---|---:|---:|" + "---:|" * (len(names) + 1),
    ]
    for variant, count in counts.items():
        shown = [count.by_object.get(name, 0.0) for name in names]
        other = count.per_request - sum(shown)
        cells = " | ".join(f"{value / 1000:.1f}k" for value in (*shown, other))
        ratio = count.per_request / first.per_request
        lines.append(f"| {variant} | {count.per_request / 1000:.1f}k | {ratio:.3f} | {cells} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", type=Variant.parse, help="NAME[@PYTHON]=DIR[:FLAGS]")
    parser.add_argument("--rates", default="4,16", help="the two loads' requests/s (default 4,16)")
    parser.add_argument("--seconds", type=float, default=10.0, help="each load's length (default 10)")
    parser.add_argument(
        "--pairs", type=int, default=3, help="pairs of loads; the median is shown (default 3)"
    )
    ns = parser.parse_args()
    low, _, high = ns.rates.partition(",")
    rates = (float(low), float(high))
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not installed (apt-get install valgrind)")
    counts: dict[str, Count] = {}
    with tempfile.TemporaryDirectory(prefix="cw-instructions-") as tmp:
        work = Path(tmp)
        sim = start_simulator(None, work, decode_rate=100)
        try:
            for variant in ns.variants:
                counts[variant.name] = measure(variant, sim.url, work, rates, ns.seconds, ns.pairs)
                count = counts[variant.name]
                every = ", ".join(f"{pair:,.0f}" for pair in count.pairs)
                print(
                    f"{variant.name}: {count.per_request:,.0f} instructions per request (pairs: {every})",
                    flush=True,
                )
        finally:
            sim.stop()
    print()
    print(table(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
