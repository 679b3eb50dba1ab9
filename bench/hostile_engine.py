"""What an engine's hostile answer head costs the sidecar: time to the 502, health meanwhile, memory.

    .venv/bin/python bench/hostile_engine.py [--mib 100] [--checkout DIR] [--bound 60]

Runs `python -m proxy serve` (this checkout, or DIR's with DIR/.venv) in front of an
engine that answers with an endless header value, a `--mib` MiB block of 1 MiB headers, or
101 small headers, and probes `/-/healthy` every 50 ms while each attack runs. The table has
the attack's answer and how long it took, the slowest health probe, and the sidecar's peak RSS
(VmHWM) after it. Issue 27 measured today's main: an endless header froze the sidecar (health
included) for 7-13 s, a 100 MB header block took it to ~1 GB. An attack that takes past
`--bound` seconds is reported as such, and the run stops there (the sidecar may be stuck).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

PIECE = 64 * 1024
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def _attack(path: bytes, writer: asyncio.StreamWriter, mib: int) -> None:
    """Write the answer that attacks; stop when the sidecar cuts the connection."""
    if path == b"/endless":
        writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
        for _ in range(4 * mib * 1024 * 1024 // PIECE):
            writer.write(b"a" * PIECE)
            await writer.drain()
    elif path == b"/block":
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for index in range(mib):
            writer.write(b"X-Block-%d: " % index)
            for _ in range(1024 * 1024 // PIECE):
                writer.write(b"b" * PIECE)
                await writer.drain()
            writer.write(b"\r\n")
        writer.write(b"Content-Length: 2\r\n\r\nok")
    elif path == b"/many":
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-H%d: %d\r\n" % (i, i) for i in range(100)))
        writer.write(b"Content-Length: 2\r\n\r\nok")
    else:
        writer.write(OK)


async def _engine(mib: int) -> tuple[asyncio.Server, int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await _attack(head.split(b" ", 2)[1].partition(b"?")[0], writer, mib)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the sidecar closed the connection, or the run is over
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _wait_ready(http: aiohttp.ClientSession, url: str) -> None:
    for _ in range(300):  # bounded: 30 s
        try:
            async with http.get(f"{url}/-/ready") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.1)
    raise SystemExit("the sidecar never became ready")


async def _one(http: aiohttp.ClientSession, url: str, path: str, bound: float) -> tuple[str, float, float]:
    """The attack's answer and seconds, and the slowest health probe while it ran."""
    started = time.monotonic()

    async def attack() -> str:
        async with http.get(f"{url}{path}") as response:
            body = await response.read()
            if response.status >= 400:
                return f"{response.status} {json.loads(body)['error']['code']}"
            return f"{response.status}, {len(body)} body bytes"

    task = asyncio.create_task(attack())
    slowest = 0.0
    while not task.done() and time.monotonic() - started < bound:
        probe = time.monotonic()
        try:
            async with asyncio.timeout(bound), http.get(f"{url}/-/healthy") as response:
                await response.read()
        except TimeoutError:
            pass
        slowest = max(slowest, time.monotonic() - probe)
        await asyncio.wait({task}, timeout=0.05)
    if not task.done():
        task.cancel()
        return f"no answer within {bound:g} s", time.monotonic() - started, slowest
    try:
        answer = task.result()
    except aiohttp.ClientError as exc:
        answer = type(exc).__name__
    return answer, time.monotonic() - started, slowest


async def main() -> None:
    """Start the engine and the sidecar, run each attack, print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=100, help="size of the header block (the endless one: 4x)")
    parser.add_argument("--checkout", type=Path, help="another checkout (with its .venv) serves instead")
    parser.add_argument("--bound", type=float, default=60.0, metavar="S")
    args = parser.parse_args()
    server, engine_port = await _engine(args.mib)
    port = _free_port()
    evidence = Path(tempfile.mkdtemp()) / "ev.jsonl"
    checkout = (args.checkout or Path(__file__).parent.parent).absolute()
    python = str(checkout / ".venv" / "bin" / "python") if args.checkout else sys.executable
    serve = [python, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{engine_port}"]
    serve += ["--listen", f"127.0.0.1:{port}", "--engine", "vllm", "--evidence", str(evidence)]
    process = subprocess.Popen(serve, stderr=subprocess.DEVNULL, cwd=checkout)  # noqa: ASYNC220  # started once, before any load
    url = f"http://127.0.0.1:{port}"
    print(f"sidecar: {checkout}; block {args.mib} MiB, endless header up to {4 * args.mib} MiB")
    print("| attack | answer | seconds | slowest /-/healthy (s) | sidecar peak RSS (MiB) |")
    print("|---|---|---:|---:|---:|")
    try:
        async with aiohttp.ClientSession() as http:
            await _wait_ready(http, url)
            print(f"| (idle) | | | | {_peak_rss_mib(process.pid):.0f} |")
            for path in ("/many", "/block", "/endless"):
                answer, took, slowest = await _one(http, url, path, args.bound)
                print(
                    f"| {path} | {answer} | {took:.2f} | {slowest:.3f} | {_peak_rss_mib(process.pid):.0f} |"
                )
                if answer.startswith("no answer"):
                    break
    finally:
        process.terminate()
        process.wait(timeout=30)
        server.close()


if __name__ == "__main__":
    asyncio.run(main())
