"""Sidecar RSS and engine requests held by clients that stop reading their answer (issue 27, M8).

    .venv/bin/python bench/stalled_clients.py [--clients 20 50] [--limit-s 20]

For each client count N, twice (client_write_timeout off, then `--limit-s`): a fresh simulator
(unthrottled) and a fresh `python -m proxy serve`; N raw connections with a 4 KiB receive
buffer each ask for a 100,000-token stream and read nothing. Once the relay waits on every one
of them (cachewitness_buffered_request_bytes holds 256 KiB each, limit off) or once the limit
has cut all of them, the sidecar's peak and current RSS and the engine's running requests.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import free_port, start_service, start_simulator

HELD_PER_CLIENT = 256 * 1024  # the relay's mark (proxy/upstream/response.py HIGH_WATER)
STREAM = orjson.dumps(
    {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 100_000,
        "stream": True,
    }
)
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
    b"Content-Length: " + str(len(STREAM)).encode() + b"\r\n\r\n" + STREAM
)
SETTLE_S = 300.0  # bounds each wait for the state to be reached


def rss_mb(pid: int) -> float:
    """The process's resident set now (VmRSS), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def stalled_client(port: int) -> socket.socket:
    """A connection that sent its stream request and reads nothing."""
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", port))
    client.sendall(REQUEST)
    return client


def sample(text: str, name: str) -> float:
    """One unlabelled sample of a /metrics answer."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


async def wait_for(check: Callable[[], Awaitable[bool]], what: str) -> float:
    """Poll `check` until it holds, for up to SETTLE_S; the seconds waited."""
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > SETTLE_S:
            sys.exit(f"bench: {what} was not reached in {SETTLE_S:.0f} s")
        await asyncio.sleep(0.2)
    return time.monotonic() - started


async def one(clients: int, limit_s: float, root: Path) -> tuple[float, float, float, int, int]:
    """(idle MB, peak MB, after MB, engine requests running at most, engine requests running after)."""
    engine = await asyncio.to_thread(start_simulator, None, root)
    port = free_port()
    argv = [sys.executable, "-m", "proxy", "serve", "--upstream", engine.url, "--listen", f"127.0.0.1:{port}"]
    argv += ["--evidence", str(root / "ev.jsonl"), "--client-write-timeout", f"{limit_s:g}"]
    argv += ["--max-buffered-bytes", str(1 << 40)]  # the relays' holds must not crowd out anything here
    sidecar = await asyncio.to_thread(
        start_service, "sidecar", argv, f"http://127.0.0.1:{port}", root, "/-/ready"
    )
    sockets: list[socket.socket] = []
    most_running = 0
    try:
        idle = rss_mb(sidecar.proc.pid)
        async with aiohttp.ClientSession() as http:

            async def metrics() -> str:
                async with http.get(sidecar.url + "/metrics") as response:
                    return await response.text()

            async def running() -> int:
                nonlocal most_running
                async with http.get(engine.url + "/sim/stats") as response:
                    now = int((await response.json())["running"])
                most_running = max(most_running, now)
                return now

            sockets = [stalled_client(port) for _ in range(clients)]

            async def all_held() -> bool:
                now = await running()
                held = sample(await metrics(), "cachewitness_buffered_request_bytes")
                print(f"  (engine running {now}, relays hold {held / 1e6:.1f} MB)", file=sys.stderr, end="\r")
                return held >= clients * HELD_PER_CLIENT

            async def all_cut() -> bool:
                await running()
                text = await metrics()
                hits = 'cachewitness_connection_limit_hits_total{limit="client_write_timeout"}'
                return sample(text, hits) >= clients

            if limit_s:
                await wait_for(all_cut, f"all {clients} clients cut")
            else:
                await wait_for(all_held, f"the relay waiting on all {clients} clients")
                await asyncio.sleep(10)  # nothing lets go of them
            after = await running()
        return idle, peak_rss_mb(sidecar.proc.pid), rss_mb(sidecar.proc.pid), most_running, after
    finally:
        for client in sockets:
            client.close()
        await asyncio.to_thread(sidecar.stop)
        await asyncio.to_thread(engine.stop)


async def main_async(levels: list[int], limit_s: float) -> None:
    print("## Clients that stop reading: sidecar RSS (MB = 10^6 bytes) and engine requests held")
    print()
    print(
        "| stalled clients | client_write_timeout | RSS idle | RSS peak | RSS after | engine requests held: most → after |"
    )
    print("|---:|---|---:|---:|---:|---|")
    for level in levels:
        for limit in (0.0, limit_s):
            with tempfile.TemporaryDirectory(prefix="cachewitness-stalls-") as root:
                idle, peak, after, most, running_after = await one(level, limit, Path(root))
            shown = f"{limit:g} s" if limit else "off"
            print(f"| {level} | {shown} | {idle:.0f} | {peak:.0f} | {after:.0f} | {most} → {running_after} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[20, 50])
    parser.add_argument("--limit-s", type=float, default=20.0)
    args = parser.parse_args()
    asyncio.run(main_async(args.clients, args.limit_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
