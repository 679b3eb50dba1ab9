"""What the canary adds to a reset: `POST /cache/reset` with `verify: none` and with `verify: canary`.

    .venv/bin/python bench/canary_cost.py [--rounds 15] [--upstream URL --label NAME]

Without `--upstream`: the simulator (each dialect; the simulator's default prefill 5,000 tok/s and
decode 50 tok/s, so each canary request costs what a small engine would) behind an in-process
sidecar. With `--upstream URL`: a running engine (e.g. a real vLLM), with a sidecar in front of it.
The two kinds of reset alternate round by round; the table gives the medians of the time the
client waited for the answer, the difference, and the canary's own `verification.elapsed_s`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.config import Settings
from proxy.serve import serving
from proxy.sim import SimConfig, running_sim

SIM_CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("vllm", {}),
    ("sglang", {}),
    ("llamacpp", {"slot_save_path": "."}),
    ("mindnano", {}),
)


@asynccontextmanager
async def sidecar(upstream: str, evidence: Path) -> AsyncIterator[str]:
    """A sidecar on a free loopback port in front of `upstream`."""
    settings = Settings(upstream=upstream, listen="127.0.0.1:0", evidence=str(evidence), health_interval=0.5)
    async with serving(settings) as url:
        yield url


async def timed_reset(http: aiohttp.ClientSession, base: str, verify: str) -> tuple[float, dict[str, Any]]:
    """Seconds the client waited for one reset answer, and the answer."""
    started = time.perf_counter()
    async with http.post(f"{base}/cache/reset", json={"verify": verify}) as resp:
        answer: dict[str, Any] = await resp.json()
    return time.perf_counter() - started, answer


async def measure(base: str, rounds: int) -> dict[str, Any]:
    """Alternate plain and canary resets; medians and what the canary said."""
    plain: list[float] = []
    canary: list[float] = []
    inside: list[float] = []
    verified: set[str] = set()
    tokens: set[int] = set()
    async with aiohttp.ClientSession() as http:
        await timed_reset(http, base, "canary")  # warm: models listed, connections open
        for _ in range(rounds):
            plain.append((await timed_reset(http, base, "none"))[0])
            elapsed, answer = await timed_reset(http, base, "canary")
            canary.append(elapsed)
            inside.append(answer["verification"]["elapsed_s"])
            verified.add(answer["verified"])
            tokens.add(answer["verification"]["canary_tokens"] or 0)
    return {
        "plain_ms": statistics.median(plain) * 1000,
        "canary_ms": statistics.median(canary) * 1000,
        "added_ms": (statistics.median(canary) - statistics.median(plain)) * 1000,
        "inside_ms": statistics.median(inside) * 1000,
        "inside_p90_ms": sorted(inside)[int(0.9 * (len(inside) - 1))] * 1000,
        "verified": ",".join(sorted(verified)),
        "tokens": ",".join(str(t) for t in sorted(tokens)),
    }


def row(label: str, result: dict[str, Any]) -> str:
    """One table row."""
    return (
        f"| {label} | {result['tokens']} | {result['plain_ms']:.1f} | {result['canary_ms']:.1f} | "
        f"{result['added_ms']:.1f} | {result['inside_ms']:.1f} | {result['inside_p90_ms']:.1f} | "
        f"{result['verified']} |"
    )


async def main_async(ns: argparse.Namespace) -> None:
    """Measure and print the table."""
    print(
        "| engine | canary prompt tokens | reset, verify none (ms, median) | reset, verify canary (ms, median) "
        "| added (ms) | canary elapsed_s (ms, median) | canary elapsed_s p90 (ms) | verified |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory(prefix="cw-canary-cost-") as tmp:
        if ns.upstream:
            async with sidecar(ns.upstream, Path(tmp) / "ev.jsonl") as base:
                await asyncio.sleep(1.0)  # detection and the first health probe
                print(row(ns.label, await measure(base, ns.rounds)), flush=True)
            return
        for dialect, options in SIM_CASES:
            config = SimConfig(dialect=dialect, **options)
            async with running_sim(config) as engine, sidecar(engine, Path(tmp) / f"{dialect}.jsonl") as base:
                await asyncio.sleep(0.6)
                print(row(f"simulator {dialect}", await measure(base, ns.rounds)), flush=True)


def main() -> int:
    """Parse the options and run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--upstream", default=None, help="a running engine's base URL instead of the simulator"
    )
    parser.add_argument("--label", default="engine", help="the table's name for --upstream")
    asyncio.run(main_async(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
