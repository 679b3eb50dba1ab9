"""The evidence writer's CPU per request at a paced rate: records queued as requests finish, the
writer's own flush task writing them (its wake-ups, its thread hop, the chain, the write).

    .venv/bin/python bench/evidence_flush_cost.py [--rates 100,400] [--seconds 5] [--rounds 3]

Run with PYTHONPATH pointing at another checkout to compare versions (it speaks `write` and,
where the writer has it, `write_later`). At a deployment's rate each flush runs cold, and a flush
costs the same fixed work whether it carries 20 records or 80 (bench/README.md, issue 34): the
figure is this process's CPU (`time.process_time`, every thread) over the run, divided by the
records, with the records' own building included, less the same run without a writer (the
wake-ups and the observations alone) measured just before. One record is queued every 1 / rate seconds
(a sleep between: the loop idles as a sidecar's does), as the recorder does, and the run ends
with the last flush. uvloop, the whole process pinned to the last allowed core. Median of the rounds.
The CPU figure is noisy (a wake-up of an idle process costs ~100-200 µs here and moves with the
machine); the wake-ups the writer adds (voluntary context switches, both runs' difference) do not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import uvloop

from proxy.evidence.writer import EvidenceWriter
from proxy.observe.record import Observation
from proxy.vocabulary import Outcome


def _observation(n: int) -> Observation:
    """A chat completion's observation as the simulator's answer gives it (~650 bytes a line)."""
    now = time.time_ns()
    return Observation(
        f"{n:032x}",
        "bench-session",
        "case-0001",
        "POST",
        "/v1/chat/completions",
        200,
        False,
        "tiny-model",
        30,
        8,
        16,
        "usage.prompt_tokens_details.cached_tokens",
        "reset-0001",
        n,
        now,
        now,
        now,
        Outcome.OK,
        True,
        "chatcmpl-1f954fc7365c794c93446a58760e5fde",
        False,
    )


async def _run(rate: float, seconds: float, path: Path | None) -> tuple[float, int]:
    """CPU seconds and voluntary context switches (every thread's sleeps, so its wake-ups) for
    `seconds` of records at `rate` a second (`path` None: the same wake-ups and observations, no
    writer: the baseline taken off)."""
    writer = EvidenceWriter(path) if path is not None else None
    if writer is not None:
        await writer.start()
    later = getattr(writer, "write_later", None)
    start = time.monotonic()
    cpu, switches = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    for n in range(int(rate * seconds)):
        observation = _observation(n)
        if later is not None:
            later("infer.cache_observation", observation.to_record)
        elif writer is not None:
            writer.write(observation.to_record())
        await asyncio.sleep(max(0.0, start + (n + 1) / rate - time.monotonic()))
    if writer is not None:
        await writer.close()
    return time.process_time() - cpu, resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100,400", help="records (requests) a second, comma-separated")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    print(
        "| rate | writer's CPU µs per record (every round) | median | writer's wake-ups per second (median) |"
    )
    print("|---:|---|---:|---:|")
    for rate in (float(r) for r in ns.rates.split(",")):
        figures, wakes = [], []
        for _ in range(ns.rounds):
            baseline, base_switches = uvloop.run(_run(rate, ns.seconds, None))
            with tempfile.TemporaryDirectory(prefix="cw-flush-") as tmp:
                spent, switches = uvloop.run(_run(rate, ns.seconds, Path(tmp) / "ev.jsonl"))
            figures.append(1e6 * (spent - baseline) / int(rate * ns.seconds))
            wakes.append((switches - base_switches) / ns.seconds)
        every = " / ".join(f"{f:.1f}" for f in figures)
        print(f"| {rate:g}/s | {every} | {statistics.median(figures):.1f} | {statistics.median(wakes):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
