"""The sidecar's CPU while idle: no request, its engine up (issue 34).

Starts the vLLM simulator and, one after the other, the sidecar with its defaults and bare
(`--no-observe --no-inject-usage`), waits until each is ready and has settled, then reads
every thread of the sidecar's process over `--seconds` (20): CPU from
`/proc/PID/task/TID/schedstat` (nanoseconds) and wake-ups from the voluntary context switches
in `/proc/PID/task/TID/status` (a thread that sleeps and is woken counts one). CPU time, not
wall-clock time: other work on the machine does not move it much.

    .venv/bin/python bench/idle_cpu.py [--seconds 20] [--rounds 2] [--threads]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness import Service, start_simulator
from paths import BARE, start_sidecar

# After ready: detection, the first health probes and the evidence chain's opening are done.
SETTLE_S = 3.0
VARIANTS: dict[str, list[str]] = {"defaults": [], "bare": BARE}


@dataclass(frozen=True)
class ThreadReading:
    """One thread's counters at one instant."""

    name: str
    cpu_ns: int
    wakeups: int


def read_threads(pid: int) -> dict[int, ThreadReading]:
    """Every live thread of `pid`: its name, CPU nanoseconds run and voluntary switches."""
    threads: dict[int, ThreadReading] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return threads
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            cpu = int(Path(f"{base}/schedstat").read_text().split()[0])
            status = Path(f"{base}/status").read_text().splitlines()
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
        fields = dict(line.split(":\t", 1) for line in status if ":\t" in line)
        threads[int(tid)] = ThreadReading(
            fields.get("Name", "?").strip(), cpu, int(fields.get("voluntary_ctxt_switches", "0"))
        )
    return threads


@dataclass(frozen=True)
class Sample:
    """What one idle window cost: totals per second, and per thread name."""

    seconds: float
    cpu_ms_per_s: float
    wakeups_per_s: float
    by_thread: dict[str, tuple[float, float]]  # name -> (ms of CPU per s, wake-ups per s)


def sample(pid: int, seconds: float) -> Sample:
    """Read the process's threads `seconds` apart; threads born inside the window count from zero."""
    before = read_threads(pid)
    started = time.monotonic()
    time.sleep(seconds)
    after = read_threads(pid)
    window = time.monotonic() - started
    by_thread: dict[str, tuple[float, float]] = {}
    cpu_total = wake_total = 0
    for tid, now in after.items():
        then = before.get(tid, ThreadReading(now.name, 0, 0))
        cpu, wakes = now.cpu_ns - then.cpu_ns, now.wakeups - then.wakeups
        cpu_total += cpu
        wake_total += wakes
        old_cpu, old_wakes = by_thread.get(now.name, (0.0, 0.0))
        by_thread[now.name] = (old_cpu + cpu / 1e6 / window, old_wakes + wakes / window)
    return Sample(window, cpu_total / 1e6 / window, wake_total / window, by_thread)


def main() -> int:
    """Measure each variant `--rounds` times, print a table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each idle window")
    parser.add_argument("--rounds", type=int, default=1, help="windows per variant (each on a fresh sidecar)")
    parser.add_argument("--threads", action="store_true", help="also print each thread's share")
    args = parser.parse_args()
    results: dict[str, list[Sample]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="idle-cpu-") as tmp:
        work = Path(tmp)
        sim = start_simulator(None, work)
        try:
            for _ in range(args.rounds):
                for name, extra in VARIANTS.items():
                    sidecar: Service = start_sidecar(f"sidecar-{name}", sim.url, extra, None, work)
                    try:
                        time.sleep(SETTLE_S)
                        results[name].append(sample(sidecar.proc.pid, args.seconds))
                    finally:
                        sidecar.stop()
        finally:
            sim.stop()
    print(f"idle sidecar, {args.seconds:g} s per window, schedstat of every thread\n")
    print("| sidecar | ms of CPU per s | wake-ups per s |")
    print("|---|---:|---:|")
    for name, samples in results.items():
        cpu_cells = " / ".join(f"{s.cpu_ms_per_s:.2f}" for s in samples)
        wake_cells = " / ".join(f"{s.wakeups_per_s:.1f}" for s in samples)
        print(f"| {name} | {cpu_cells} | {wake_cells} |")
    if args.threads:
        print("\n| sidecar | thread | ms of CPU per s | wake-ups per s |")
        print("|---|---|---:|---:|")
        for name, samples in results.items():
            for thread, (cpu_ms, wake_rate) in sorted(samples[-1].by_thread.items()):
                print(f"| {name} | {thread} | {cpu_ms:.2f} | {wake_rate:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
