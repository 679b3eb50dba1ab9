"""Throughput of the engine simulator at decode/prefill rate 0 (a benchmark, not a test).

Starts `run_sim` in a child process (one core, uvloop), drives it from this process
with keep-alive aiohttp clients, and prints a table of requests per second.

    .venv/bin/python bench/sim_throughput.py [--seconds 3] [--concurrency 32] [--dialects vllm,llamacpp]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True)
class Row:
    """One measured case."""

    dialect: str
    case: str
    requests: int
    seconds: float

    @property
    def rate(self) -> float:
        """Requests per second."""
        return self.requests / self.seconds


def _free_port() -> int:
    """A free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _start_sim(dialect: str) -> tuple[asyncio.subprocess.Process, str]:
    """Start the simulator in a child process; return it and its URL once it listens."""
    port = _free_port()
    code = (
        "from proxy.sim import SimConfig, run_sim; "
        f"raise SystemExit(run_sim(SimConfig(dialect={dialect!r}, decode_rate=0, prefill_rate=0, slots=64), "
        f"'127.0.0.1', {port}))"
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    await asyncio.wait_for(proc.stderr.readline(), 30)
    return proc, f"http://127.0.0.1:{port}"


async def _drive(url: str, body: dict[str, object], seconds: float, concurrency: int) -> tuple[int, float]:
    """Send requests from `concurrency` keep-alive workers for `seconds`; count the 200s."""
    done = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        start = time.perf_counter()
        deadline = start + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                async with http.post(url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    if resp.status == 200:
                        done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done, time.perf_counter() - start


async def main() -> int:
    """Measure each dialect and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--dialects", default="vllm,llamacpp")
    args = parser.parse_args()
    small = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hello there, how are you?"}],
        "max_tokens": 16,
    }
    cases = {
        "chat, 16 tokens": small,
        "chat stream, 16 tokens": {**small, "stream": True, "stream_options": {"include_usage": True}},
    }
    rows: list[Row] = []
    for dialect in args.dialects.split(","):
        proc, url = await _start_sim(dialect)
        try:
            for case, body in cases.items():
                requests, seconds = await _drive(url, body, args.seconds, args.concurrency)
                rows.append(Row(dialect, case, requests, seconds))
        finally:
            proc.terminate()
            await proc.wait()
    print(f"{'dialect':<10} {'case':<24} {'requests':>9} {'seconds':>8} {'req/s':>8}")
    for row in rows:
        print(f"{row.dialect:<10} {row.case:<24} {row.requests:>9} {row.seconds:>8.2f} {row.rate:>8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
