"""What observing costs: CPU per request of the sidecar with and without evidence + injection.

    .venv/bin/python bench/observe_cost.py [--rounds 5] [--seconds 4] [--concurrency 64] [--against DIR]

A focused A/B of `make bench`'s "evidence + injection" aim: one simulator (vLLM dialect,
decode/prefill 0) and two sidecars in front of it — defaults, and `--no-observe
--no-inject-usage` — each pinned alone on the same core, driven in turn by wrk with small
non-streaming chat completions. CPU seconds per request (from /proc) is the figure that
holds on a shared machine; the table gives every round and the median difference.
`--against DIR` adds a third sidecar, defaults, run from another checkout's code (e.g. a
`git worktree` of the commit before a change): a before/after of one change, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Cores, cpu_seconds, ensure_tools, free_port, start_service, start_simulator
from loads import WRK_SCRIPT, run_wrk

PATHS: tuple[tuple[str, list[str]], ...] = (
    ("observed (defaults)", []),
    ("bare (--no-observe --no-inject-usage)", ["--no-observe", "--no-inject-usage"]),
)


def main() -> int:
    """Run the A/B and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--against", type=Path, help="another checkout: its sidecar (defaults) runs too")
    ns = parser.parse_args()
    paths = list(PATHS)
    if ns.against is not None:
        ns.against = ns.against.resolve()
        paths.append((f"observed, from {ns.against}", []))
    _, wrk = ensure_tools()
    cores = Cores.choose(pin=True)
    with tempfile.TemporaryDirectory(prefix="cw-observe-cost-") as tmp:
        work = Path(tmp)
        script = work / "post.lua"
        script.write_text(WRK_SCRIPT)
        sim = start_simulator(cores.rest, work)
        sidecars = []
        for index, (_name, extra) in enumerate(paths):
            listen = free_port()
            # `python -m` puts the working directory first on sys.path: the other checkout's
            # code runs when started from there (exec keeps the pid we measure).
            where = ["sh", "-c", f'cd "{ns.against}" && exec "$0" "$@"'] if index == len(PATHS) else []
            sidecars.append(
                start_service(
                    f"sidecar{index}",
                    [
                        *Cores.prefix(cores.proxy),
                        *where,
                        sys.executable,
                        "-m",
                        "proxy",
                        "serve",
                        "--upstream",
                        sim.url,
                        "--listen",
                        f"127.0.0.1:{listen}",
                        "--evidence",
                        str(work / f"sidecar{index}.jsonl"),
                        *extra,
                    ],
                    f"http://127.0.0.1:{listen}",
                    work,
                    "/-/ready",
                )
            )
        per_request: dict[str, list[float]] = {name: [] for name, _ in paths}
        try:
            for _ in range(ns.rounds):
                for (name, _), sidecar in zip(paths, sidecars, strict=True):
                    before = cpu_seconds(sidecar.pids())
                    result = run_wrk(
                        wrk,
                        Cores.prefix(cores.rest),
                        script,
                        sidecar.url + "/v1/chat/completions",
                        ns.concurrency,
                        ns.seconds,
                    )
                    spent = cpu_seconds(sidecar.pids()) - before
                    per_request[name].append(1e6 * spent / max(1.0, result["requests"]))
        finally:
            for service in (*sidecars, sim):
                service.stop()
    observed, bare = (statistics.median(per_request[name]) for name, _ in PATHS)
    print(
        f"sidecar CPU per request, µs (wrk c={ns.concurrency}, {ns.rounds} × {ns.seconds:g} s, "
        f"sidecars pinned to core {cores.proxy}, simulator + wrk to core {cores.rest})\n"
    )
    print("| path | " + " | ".join(f"round {i + 1}" for i in range(ns.rounds)) + " | median |")
    print("|---|" + "---:|" * (ns.rounds + 1))
    for name, _ in paths:
        values = per_request[name]
        print(
            f"| {name} | " + " | ".join(f"{v:.0f}" for v in values) + f" | {statistics.median(values):.0f} |"
        )
    print(
        f"\nobserving costs {observed - bare:+.0f} µs per request ({100 * (observed - bare) / bare:+.1f} %)"
    )
    if ns.against is not None:
        other = statistics.median(per_request[paths[-1][0]])
        print(
            f"this checkout vs {ns.against}: {observed - other:+.0f} µs per request ({100 * (observed - other) / other:+.1f} %)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
