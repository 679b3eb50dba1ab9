"""Peak RSS of the sidecar under concurrent large request bodies (issue 16 item 1).

    .venv/bin/python bench/body_memory.py [--mib 63] [--concurrency 1 4 8]

For each concurrency N: a fresh `python -m proxy serve` in front of a small engine that reads
each body and answers once all N are in (so every body is in flight at the same moment); N
non-stream chat POSTs of `--mib` MiB at once. Prints the sidecar's peak RSS (VmHWM), how many
bodies were observed (buffered within max_buffered_bytes) and how many streamed unobserved.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import tempfile
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import free_port, start_service

MIB = 1024 * 1024


def engine_app(expected: int) -> web.Application:
    """Reads each body, answers when `expected` bodies are in."""
    arrived: list[int] = []
    all_in = asyncio.Event()

    async def chat(request: web.Request) -> web.Response:
        length = 0
        async for chunk in request.content.iter_any():
            length += len(chunk)
        arrived.append(length)
        if len(arrived) >= expected:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), timeout=300)
        return web.json_response(
            {"usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}
        )

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application(client_max_size=1024 * MIB)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def unobserved(metrics: str) -> int:
    for line in metrics.splitlines():
        if line.startswith('cachewitness_requests_unobserved_total{reason="max_buffered_bytes"}'):
            return int(float(line.split()[-1]))
    return -1


async def one(concurrency: int, body: bytes, root: Path) -> tuple[float, float, int, int]:
    """(idle peak MB, loaded peak MB, observed, unobserved) for one concurrency."""
    runner = web.AppRunner(engine_app(concurrency), access_log=None)
    await runner.setup()
    engine_port, proxy_port = free_port(), free_port()
    await web.TCPSite(runner, "127.0.0.1", engine_port).start()
    argv = [sys.executable, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{engine_port}"]
    argv += [
        "--listen",
        f"127.0.0.1:{proxy_port}",
        "--engine",
        "generic",
        "--evidence",
        str(root / "ev.jsonl"),
    ]
    sidecar = await asyncio.to_thread(
        start_service, "sidecar", argv, f"http://127.0.0.1:{proxy_port}", root, "/-/healthy"
    )
    try:
        idle = peak_rss_mb(sidecar.proc.pid)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:

            async def post() -> int:
                async with client.post(
                    sidecar.url + "/v1/chat/completions",
                    data=io.BytesIO(body),
                    headers={"Content-Type": "application/json"},
                ) as response:
                    await response.read()
                    return response.status

            statuses = await asyncio.gather(*(post() for _ in range(concurrency)))
            async with client.get(sidecar.url + "/metrics") as response:
                skipped = unobserved(await response.text())
        assert statuses == [200] * concurrency, statuses
        return idle, peak_rss_mb(sidecar.proc.pid), concurrency - skipped, skipped
    finally:
        await asyncio.to_thread(sidecar.stop)
        await runner.cleanup()


async def main_async(mib: int, levels: list[int]) -> None:
    head, tail = b'{"model":"m","messages":[{"role":"user","content":"', b'"}]}'
    body = head + b"x" * (mib * MIB - len(head) - len(tail)) + tail
    print(f"## Sidecar RSS with concurrent {mib} MiB request bodies (max_buffered_bytes 256 MiB)")
    print()
    print(
        "| concurrent bodies | peak RSS idle (MB) | peak RSS loaded (MB) | observed | streamed unobserved |"
    )
    print("|---:|---:|---:|---:|---:|")
    for level in levels:
        with tempfile.TemporaryDirectory(prefix="cachewitness-bodies-") as root:
            idle, loaded, observed, skipped = await one(level, body, Path(root))
        print(f"| {level} | {idle:.0f} | {loaded:.0f} | {observed} | {skipped} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mib", type=int, default=63)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    args = parser.parse_args()
    asyncio.run(main_async(args.mib, args.concurrency))
    return 0


if __name__ == "__main__":
    sys.exit(main())
