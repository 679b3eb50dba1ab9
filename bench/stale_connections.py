"""How often an engine's idle-connection close turns into a 502 through the sidecar.

    .venv/bin/python bench/stale_connections.py [--requests 300] [--engine-keepalive 0.2]

uvicorn (vLLM, SGLang) closes an idle connection after 5 s; a request the sidecar writes
onto a pooled connection as the engine closes it gets no answer. This runs the simulator
with a short keep-alive (`--engine-keepalive`), a sidecar (in process, defaults) in front of
it, and sends requests one after another, each pause drawn around the engine's keep-alive
so that many land in the race: chat completions, then `POST /cache/reset`. The table counts
the answers by status. Zero 502s (and zero `unreachable` resets) is the aim (issue 13, item 4).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from proxy.app import build_app
from proxy.config import Settings
from proxy.serve import make_runner, make_site
from proxy.sim import SimConfig, running_sim

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


async def _run(path: str, count: int, engine_keepalive: float) -> tuple[Counter[str], float]:
    """`count` requests on `path` through a fresh sidecar; statuses (and reset answers) counted."""
    config = SimConfig(dialect="vllm", decode_rate=0, prefill_rate=0, keepalive_timeout=engine_keepalive)
    seen: Counter[str] = Counter()
    rng = random.Random(13)
    async with running_sim(config) as engine:
        settings = Settings(
            upstream=engine, listen="127.0.0.1:0", evidence=str(Path(tempfile.mkdtemp()) / "ev.jsonl")
        )
        runner = make_runner(build_app(settings), settings)
        await runner.setup()
        site = make_site(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        started = time.monotonic()
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(count):
                    body = {"drain": False, "retry_seconds": 0} if path == "/cache/reset" else CHAT
                    async with http.post(f"http://{host}:{port}{path}", json=body) as response:
                        answer = await response.json(content_type=None)
                        label = str(response.status)
                        if path == "/cache/reset":
                            label += f" {answer.get('answer')}"
                        seen[label] += 1
                    await asyncio.sleep(engine_keepalive * rng.uniform(0.9, 1.1))
        finally:
            await runner.cleanup()
    return seen, time.monotonic() - started


async def main() -> None:
    """Run both paths and print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--engine-keepalive", type=float, default=0.2, metavar="S")
    args = parser.parse_args()
    print(f"engine keep-alive {args.engine_keepalive} s, sidecar upstream_keepalive_timeout default (4 s)")
    print("| path | requests | answers by status | 502s | seconds |\n|---|---|---|---|---|")
    for path in ("/v1/chat/completions", "/cache/reset"):
        seen, took = await _run(path, args.requests, args.engine_keepalive)
        bad = sum(n for label, n in seen.items() if label.startswith("502"))
        answers = ", ".join(f"{label}: {n}" for label, n in sorted(seen.items()))
        print(f"| {path} | {args.requests} | {answers} | {bad} | {took:.0f} |")


if __name__ == "__main__":
    asyncio.run(main())
