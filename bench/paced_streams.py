"""The sidecar's CPU per SSE event when events come as an engine sends them: paced, one at a time.

    .venv/bin/python bench/paced_streams.py [--streams 200] [--rate 50] [--rounds 3] [--seconds 5] [--against DIR] [--nginx]

`make bench` streams at decode rate 0: events arrive in bursts, and the CPU per event it
reports depends on how many events each read and write carries, which moves with how busy
each core is. Here the simulator (vLLM dialect) decodes each sequence at `--rate` tokens/s,
so with `--streams` streams the sidecar relays about streams × rate events/s, each on its
own: the per-event cost of a real deployment, where an engine emits a token every few
milliseconds per sequence. The sidecar (defaults: evidence and injection on) runs pinned alone
on one core; the simulator and the load generator (bench/sse_load.py) share the other.
`--against DIR` adds the same sidecar run from another checkout's code, interleaved round by
round: a before/after. `--nginx` adds nginx (one worker, as in `make bench`) on the sidecar's core,
interleaved too: what a streaming proxy in C costs per event relayed alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Cores, cpu_seconds, ensure_tools, free_port, start_service, start_simulator
from loads import run_sse
from nginx_conf import start_nginx


def main() -> int:
    """Start the simulator and the sidecars, run the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--rate", type=float, default=50.0, help="tokens per second per stream")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--against", type=Path, help="another checkout: its sidecar runs too")
    parser.add_argument("--nginx", action="store_true", help="nginx runs too, on the sidecar's core")
    ns = parser.parse_args()
    names = ["this checkout"]
    if ns.against is not None:
        ns.against = ns.against.resolve()
        names.append(f"from {ns.against}")
    cores = Cores.choose(pin=True)
    with tempfile.TemporaryDirectory(prefix="cw-paced-") as tmp:
        work = Path(tmp)
        sim = start_simulator(cores.rest, work, decode_rate=ns.rate)
        sidecars = []
        for index in range(len(names)):
            listen = free_port()
            # `python -m` puts the working directory first on sys.path: the other checkout's
            # code runs when started from there (exec keeps the pid we measure).
            where = ["sh", "-c", f'cd "{ns.against}" && exec "$0" "$@"'] if index == 1 else []
            sidecars.append(
                start_service(
                    f"sidecar{index}",
                    [
                        *Cores.prefix(cores.proxy),
                        *where,
                        sys.executable,
                        *("-m", "proxy", "serve", "--upstream", sim.url, "--listen", f"127.0.0.1:{listen}"),
                        *("--evidence", str(work / f"sidecar{index}.jsonl")),
                    ],
                    f"http://127.0.0.1:{listen}",
                    work,
                    "/-/ready",
                )
            )
        if ns.nginx:
            names.append("nginx (1 worker)")
            sidecars.append(start_nginx(ensure_tools()[0], cores.proxy, work, [sim.url])[0])
        per_event: dict[str, list[float]] = {name: [] for name in names}
        events_per_s: dict[str, list[float]] = {name: [] for name in names}
        try:
            for _ in range(ns.rounds):
                for name, sidecar in zip(names, sidecars, strict=True):
                    before = cpu_seconds(sidecar.pids())
                    result = run_sse(
                        Cores.prefix(cores.rest), sidecar.url, ns.streams, ns.seconds, ns.max_tokens
                    )
                    spent = cpu_seconds(sidecar.pids()) - before
                    per_event[name].append(1e6 * spent / max(1.0, result["events"]))
                    events_per_s[name].append(result["events_per_s"])
        finally:
            for service in (*sidecars, sim):
                service.stop()
    print(
        f"sidecar CPU per SSE event, µs ({ns.streams} streams at {ns.rate:g} tokens/s each, "
        f"{ns.max_tokens} tokens per stream, {ns.rounds} × {ns.seconds:g} s; sidecar pinned to core "
        f"{cores.proxy}, simulator + load generator to core {cores.rest})\n"
    )
    print("| sidecar | " + " | ".join(f"round {i + 1}" for i in range(ns.rounds)) + " | median | events/s |")
    print("|---|" + "---:|" * (ns.rounds + 2))
    for name in names:
        values = per_event[name]
        print(
            f"| {name} | "
            + " | ".join(f"{v:.2f}" for v in values)
            + f" | {statistics.median(values):.2f} | {statistics.median(events_per_s[name]):,.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
