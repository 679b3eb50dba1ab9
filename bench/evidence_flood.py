"""How fast a flood of refused requests with 8 KB ids turns the evidence over, and whether a reset survives.

    .venv/bin/python bench/evidence_flood.py [--seconds 10] [--workers 16] [--id-bytes 8000]

Runs `python -m proxy serve` (defaults, but for the evidence directory) in front of the
simulator, makes one reset, then floods the sidecar for `--seconds` with the cheapest
request there is: a chat completion that declares a body past `max_body_bytes`, refused
with 413 before any byte is read or the engine is asked, each with its own `X-Request-Id` of
`--id-bytes`. It prints the refused requests a second, the evidence bytes they cost a second
(both files), how long the observation history (`evidence_max_bytes` × (`evidence_keep` + 1))
would last at that rate, and whether `GET /cache/evidence` still serves the reset's record.
Issue 27 M7's figure before the fix: 1,764 req/s, 384 MiB turned over in 26 s, the reset gone.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from proxy.config import Settings
from proxy.sim import SimConfig, running_sim

MIB = 1024 * 1024
HISTORY_BYTES = Settings.evidence_max_bytes * (Settings.evidence_keep + 1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _refused(port: int, request_id: str) -> bool:
    """One request declaring 1 GiB of body: True when the sidecar answered 413 (else False)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1073741824\r\nX-Request-Id: " + request_id.encode() + b"\r\n\r\n"
        )
        status = await asyncio.wait_for(reader.readline(), timeout=10)
        if status.split(b" ")[1:2] != [b"413"]:
            print("answer:", status[:80], file=sys.stderr)
            return False
        return True
    finally:
        writer.close()


def _evidence_bytes(folder: Path) -> int:
    """Bytes in every evidence file of the folder (both files, their rotations)."""
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())


async def _wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(300):
            try:
                async with http.get(url + "/-/ready") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("the sidecar did not become ready")


async def main(seconds: float, workers: int, id_bytes: int) -> None:
    """Flood, measure, print."""
    folder = Path(tempfile.mkdtemp(prefix="cw-flood-"))
    port = _free_port()
    config = SimConfig(dialect="vllm", decode_rate=0, prefill_rate=0)
    async with running_sim(config) as engine:
        argv = ["serve", "--upstream", engine, "--listen", f"127.0.0.1:{port}"]
        argv += ["--evidence", str(folder / "cachewitness.jsonl")]
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", *argv, stderr=asyncio.subprocess.DEVNULL
        )
        url = f"http://127.0.0.1:{port}"
        try:
            await _wait_ready(url)
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/cache/reset", json={"session_id": "flood", "case_id": "c"}) as r:
                    reset_id = (await r.json())["reset_id"]
            before = _evidence_bytes(folder)
            refused = 0
            deadline = time.monotonic() + seconds

            async def worker(index: int) -> None:
                nonlocal refused
                n = 0
                while time.monotonic() < deadline:
                    n += 1
                    prefix = f"{index:03d}-{n:08d}-"
                    answered = await _refused(port, prefix + "x" * (id_bytes - len(prefix)))
                    refused += answered  # after the await: `refused += await …` would lose updates

            started = time.monotonic()
            await asyncio.gather(*(worker(i) for i in range(workers)))
            elapsed = time.monotonic() - started
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/cache/evidence", params={"event_type": "infer.cache_state"}) as r:
                    states = [orjson.loads(line) for line in (await r.read()).splitlines() if line]
                async with http.get(url + "/metrics") as r:
                    metrics = await r.text()
        finally:
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), timeout=60)
    written = _evidence_bytes(folder) - before
    rate_line = [line for line in metrics.splitlines() if 'evidence_dropped_total{reason="rate"}' in line]
    per_s = written / elapsed
    print(
        f"refused requests: {refused} in {elapsed:.1f} s = {refused / elapsed:,.0f}/s (ids of {id_bytes} B)"
    )
    print(f"evidence written: {written / MIB:.2f} MiB = {per_s / 1024:,.1f} KiB/s")
    if per_s:
        print(
            f"default history ({HISTORY_BYTES / MIB:.0f} MiB) turned over in {HISTORY_BYTES / per_s:,.0f} s"
        )
    print("dropped (rate):", rate_line[0].split()[-1] if rate_line else "n/a (no such reason)")
    print("reset record still served:", any(s.get("reset_id") == reset_id for s in states))
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--id-bytes", type=int, default=8000)
    args = parser.parse_args()
    asyncio.run(main(args.seconds, args.workers, args.id_bytes))
