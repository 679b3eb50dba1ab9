"""A/B at a paced load: sidecars from several checkouts (or with other flags), alternating.

    .venv/bin/python bench/paced_ab.py main=../before new=. [bare=.:--no-observe --no-inject-usage]
        [--cases r400,r100,streams] [--rounds 4]

Each VARIANT is NAME[@PYTHON]=DIR[:FLAGS]: `python -m proxy serve` run with DIR as its working
directory (so DIR's `proxy/` package is the one that runs), FLAGS added; PYTHON, the interpreter
(default: this one; a venv of it holding the project is made under .cache/ when it lacks the
project's dependencies: bench/interpreters.py). All run at once in front of one
simulator (vLLM dialect, 100 tokens/s), the sidecars on one core and the simulator and the
generator on the other, everything under SCHED_FIFO as `bench/paced.py --realtime` (root). Each
round runs every case on every variant back to back, the order turned each round; the cases
are the paced bench's (`r400`, `r100`, `r1600`, `streams`, `large`, `small20`: bench/paced.py),
without Envoy or a baseline.

Printed: every round's CPU µs per request (per SSE event for `streams`), with the p50 (time to
first event for `streams`), then per case each variant's median and minimum and its median
ratio to the first variant's in the same rounds. A paced run's rounds disagree by 5-15 % on this
machine; a variant lower in every round is the claim that holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    RT_LOADGEN_PRIORITY,
    RT_PROXY_PRIORITY,
    Cores,
    Service,
    realtime,
    set_fifo,
    start_simulator,
)
from interpreters import sidecar_python
from paced import CASES as PACED_CASES
from paths import start_sidecar

HERE = Path(__file__).resolve().parent
# The paced bench's cases (bench/paced.py): the generator's arguments and seconds.
CASES: dict[str, tuple[list[str], float]] = {
    case.name: (list(case.argv), case.seconds) for case in PACED_CASES
}


@dataclass(frozen=True)
class Variant:
    """One sidecar to compare: a name, the checkout it runs from, its extra flags."""

    name: str
    directory: Path
    flags: tuple[str, ...]
    python: str = sys.executable

    @classmethod
    def parse(cls, text: str) -> Variant:
        """NAME[@PYTHON]=DIR[:FLAGS]."""
        named, _, spec = text.partition("=")
        name, _, python = named.partition("@")
        directory, _, flags = spec.partition(":")
        if not name or not directory:
            raise argparse.ArgumentTypeError(f"{text!r}: give NAME[@PYTHON]=DIR[:FLAGS]")
        return cls(name, Path(directory).resolve(), tuple(flags.split()), sidecar_python(python or None))


def _start(variant: Variant, upstream: str, core: str | None, work: Path) -> Service:
    """The variant's sidecar, ready, under SCHED_FIFO above the generator."""
    service = start_sidecar(
        variant.name, upstream, list(variant.flags), core, work, cwd=variant.directory, python=variant.python
    )
    set_fifo(service.pids(), RT_PROXY_PRIORITY)
    return service


def _measure(service: Service, case: str, core: str | None) -> tuple[float, float | None]:
    """One case on one sidecar: CPU µs per request (per event) and the p50 in ms."""
    argv, seconds = CASES[case]
    command = [
        *Cores.prefix(core),
        *(sys.executable, str(HERE / "paced_load.py"), *argv),
        *("--url", service.url, "--seconds", f"{seconds:g}"),
        *("--cpu-pids", ",".join(map(str, service.pids())), "--fifo-priority", str(RT_LOADGEN_PRIORITY)),
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=seconds + 120).stdout
    result = json.loads(out.strip().splitlines()[-1])
    units = result["events"] if case == "streams" else result["requests"]
    p50 = result.get("ttfe_p50_ms") if case == "streams" else result.get("p50_ms")
    return 1e6 * result["proxy_cpu_s"] / max(1, units), p50


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", type=Variant.parse, help="NAME[@PYTHON]=DIR[:FLAGS]")
    parser.add_argument("--cases", default="r400,r100", help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=4)
    ns = parser.parse_args()
    cases = ns.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}")
    realtime()
    cores = Cores.choose(pin=True)
    variants: list[Variant] = ns.variants
    figures: dict[tuple[str, str], list[float]] = {(v.name, c): [] for v in variants for c in cases}
    with tempfile.TemporaryDirectory(prefix="cw-paced-ab-") as tmp:
        work = Path(tmp)
        sim = start_simulator(cores.rest, work, decode_rate=100)
        services = {v.name: _start(v, sim.url, cores.proxy, work) for v in variants}
        try:
            names = list(services)
            for index in range(ns.rounds):
                order = names if index % 2 == 0 else names[::-1]
                for case in cases:
                    for name in order:
                        us, p50 = _measure(services[name], case, cores.rest)
                        figures[(name, case)].append(us)
                        shown = f"{p50:.2f} ms" if p50 is not None else "—"
                        print(f"round {index} {case:8} {name:12} {us:8.1f} µs  p50 {shown}", flush=True)
        finally:
            for service in services.values():
                service.stop()
            sim.stop()
    print("\n| case | variant | median | min | median ratio to " + variants[0].name + " (same rounds) |")
    print("|---|---|---:|---:|---:|")
    for case in cases:
        first = figures[(variants[0].name, case)]
        for variant in variants:
            mine = figures[(variant.name, case)]
            ratio = statistics.median(m / f for m, f in zip(mine, first, strict=True))
            print(
                f"| {case} | {variant.name} | {statistics.median(mine):.1f} | {min(mine):.1f} | {ratio:.3f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
