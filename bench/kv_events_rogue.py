"""What a rogue publisher on the KV-events socket costs the sidecar (issue 45, M3): health, memory, series.

    .venv/bin/python bench/kv_events_rogue.py [--mib 60] [--checkout DIR]

Runs `python -m proxy serve` (this checkout, or DIR's with DIR/.venv) in front of the simulator,
binding a KV-events socket, and connects a publisher from the engine's own address (127.0.0.1:
admitted). It sends a `--mib` MiB batch, 20,000 invented event types and 48,000 empty stores
under invented media, and probes `/-/healthy` every 50 ms for 3 s after each. The table has the
slowest probe, the sidecar's RSS after each attack, and the `type` series of
`cachewitness_kv_events_total`. Issue 45 measured main `7e339ad`: a 60 MiB batch took RSS 88 to
1,201 MiB and stalled `/-/healthy` 8.3 s; 20,000 types made 20,000 series.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgpack
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import free_port, rss_mb, start_service, start_simulator

WATCH_S = 3.0


async def _slowest_health(http: aiohttp.ClientSession, url: str) -> float:
    """The slowest `/-/healthy` over WATCH_S, probed every 50 ms."""
    slowest, end = 0.0, time.monotonic() + WATCH_S
    while time.monotonic() < end:
        probe = time.monotonic()
        async with http.get(f"{url}/-/healthy") as response:
            await response.read()
        slowest = max(slowest, time.monotonic() - probe)
        await asyncio.sleep(0.05)
    return slowest


async def _type_series(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    return sum(line.startswith("cachewitness_kv_events_total{") for line in text.splitlines())


def _attacks(mib: int) -> list[tuple[str, list[bytes]]]:
    """Each attack's name and the payloads it publishes (seq counts on across them)."""
    hashes = mib * (1 << 20) // 9  # a msgpack uint64 is 9 bytes
    big = msgpack.packb([time.time(), [["BlockStored", [(1 << 63) + i for i in range(hashes)]]], 0])
    types = [msgpack.packb([time.time(), [[f"T{i}"] for i in range(n, n + 10_000)], 0]) for n in (0, 10_000)]
    empty = [
        msgpack.packb(
            [time.time(), [["BlockStored", [], None, [], 16, None, f"M{n + i}"] for i in range(16_000)], 0]
        )
        for n in (0, 16_000, 32_000)
    ]
    return [
        (f"{len(big) / (1 << 20):.0f} MiB batch", [big]),
        ("20,000 invented types", types),
        ("48,000 empty stores", empty),
    ]


async def main() -> None:
    """Start the simulator and the sidecar, publish each attack, print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=60, help="size of the large batch")
    parser.add_argument("--checkout", type=Path, help="another checkout (with its .venv) serves instead")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp())
    engine = start_simulator(None, logs)
    port, events = free_port(), f"tcp://127.0.0.1:{free_port()}"
    checkout = (args.checkout or Path(__file__).parent.parent).absolute()
    python = str(checkout / ".venv" / "bin" / "python") if args.checkout else sys.executable
    serve = [python, "-m", "proxy", "serve", "--upstream", engine.url, "--listen", f"127.0.0.1:{port}"]
    serve += ["--evidence", str(logs / "ev.jsonl"), "--kv-events-endpoint", events]
    url = f"http://127.0.0.1:{port}"
    sidecar = start_service("sidecar", serve, url, logs, "/-/healthy", cwd=checkout)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.connect(events)
    print(f"sidecar: {checkout}")
    print("| attack | slowest /-/healthy (s) | sidecar RSS after (MB) | `type` series |")
    print("|---|---:|---:|---:|")
    try:
        await asyncio.wait_for(pub.recv(), 10)  # the sidecar's subscription: the handshake is done
        seq = 0
        async with aiohttp.ClientSession() as http:
            print(f"| (idle) | | {rss_mb(sidecar.pids()):.0f} | {await _type_series(http, url)} |")
            for name, payloads in _attacks(args.mib):
                for payload in payloads:
                    await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
                    seq += 1
                slowest = await _slowest_health(http, url)
                series = await _type_series(http, url)
                print(f"| {name} | {slowest:.3f} | {rss_mb(sidecar.pids()):.0f} | {series} |")
    finally:
        pub.close(linger=0)
        ctx.term()
        sidecar.stop()
        engine.stop()


if __name__ == "__main__":
    asyncio.run(main())
