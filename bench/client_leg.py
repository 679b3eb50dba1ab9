"""What the upstream leg alone costs per request: aiohttp's ClientSession, the sidecar's leg, a bare client.

    .venv/bin/python bench/client_leg.py [--rounds 3] [--seconds 3] [--concurrency 16]

Sized issue 19's candidate (an upstream leg on asyncio protocols with httptools) before it
was built, and now measures it (proxy/upstream, with its timeouts, pool and flow control). One simulator (vLLM dialect, decode/prefill rate 0) on one core; this process on
the other, on uvloop as the sidecar is, sends small non-streaming chat completions with
`--concurrency` workers over keep-alive connections, with a ClientSession configured
as the sidecar's own-calls pool, with the sidecar's forwarding leg, and with a bare client (head and body in one write, the answer
parsed by httptools, its body taken as it arrives). The figure is this process's CPU µs per
request (user + system, `time.process_time`), interleaved rounds, median. The bare client
does none of the sidecar's work (timeouts, resend, flow control), so the difference is an
upper bound on what the leg could save.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httptools
import uvloop
from multidict import CIMultiDict

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Cores, start_simulator

from proxy.upstream import UpstreamLeg

BODY = (
    b'{"model":"sim-model","messages":[{"role":"user","content":"Benchmark prompt: say something short."}],'
    b'"max_tokens":16}'
)


class _Answer(asyncio.Protocol):
    """One keep-alive connection: writes a request, parses the answer with httptools."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[tuple[int, bytes]] | None = None
        self.body: list[bytes] = []
        self.headers: list[tuple[bytes, bytes]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result((self.parser.get_status_code(), b"".join(self.body)))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("closed"))

    def send(self, head: bytes, body: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self.body, self.headers = [], []
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(head + body)
        return self.done


async def _bare_worker(port: int, deadline: float) -> int:
    """Requests over one connection with the bare httptools client until the deadline."""
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(_Answer, "127.0.0.1", port)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (port, len(BODY))
    )
    count = 0
    while time.monotonic() < deadline:
        status, _ = await conn.send(head, BODY)
        assert status == 200, status
        count += 1
    assert conn.transport is not None
    conn.transport.close()
    return count


async def _session_worker(session: aiohttp.ClientSession, url: str, deadline: float) -> int:
    """Requests with the ClientSession until the deadline, the body read as the sidecar reads it."""
    count = 0
    headers = {"Content-Type": "application/json"}
    while time.monotonic() < deadline:
        async with session.post(url, data=BODY, headers=headers, allow_redirects=False) as answer:
            async for _ in answer.content.iter_any():
                pass
            assert answer.status == 200, answer.status
        count += 1
    return count


async def _leg_worker(leg: UpstreamLeg, deadline: float) -> int:
    """Requests through the sidecar's forwarding leg until the deadline, the body read as forward reads it."""
    count = 0
    headers = CIMultiDict({"Content-Type": "application/json"})
    while time.monotonic() < deadline:
        answer = await leg.send("POST", "/v1/chat/completions", headers, BODY)
        while await answer.read():
            pass
        answer.close()
        assert answer.status == 200, answer.status
        count += 1
    return count


def _session() -> aiohttp.ClientSession:
    """A ClientSession with the sidecar's pool options (proxy/upstream/pools.py)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4.0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300),
        auto_decompress=False,
        trust_env=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


async def _measure(run: Callable[[float], Awaitable[list[int]]], seconds: float) -> float:
    """CPU µs per request of this process over one timed run."""
    cpu = time.process_time()
    counts = await run(time.monotonic() + seconds)
    return 1e6 * (time.process_time() - cpu) / max(1, sum(counts))


async def _rounds(port: int, ns: argparse.Namespace) -> dict[str, list[float]]:
    """Interleaved rounds of both clients."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    results: dict[str, list[float]] = {
        "aiohttp ClientSession": [],
        "the sidecar's leg (proxy/upstream)": [],
        "bare asyncio protocol + httptools": [],
    }
    leg = UpstreamLeg(
        f"http://127.0.0.1:{port}", connect_timeout=10, read_timeout=300, keepalive=4.0, limit=0
    )
    async with _session() as session:

        async def with_session(deadline: float) -> list[int]:
            return list(
                await asyncio.gather(
                    *(_session_worker(session, url, deadline) for _ in range(ns.concurrency))
                )
            )

        async def bare(deadline: float) -> list[int]:
            return list(await asyncio.gather(*(_bare_worker(port, deadline) for _ in range(ns.concurrency))))

        async def with_leg(deadline: float) -> list[int]:
            return list(await asyncio.gather(*(_leg_worker(leg, deadline) for _ in range(ns.concurrency))))

        runs = dict(zip(results, (with_session, with_leg, bare), strict=True))
        for run in runs.values():
            await run(time.monotonic() + 0.5)  # warm-up: connections, imports
        for _ in range(ns.rounds):
            for name, run in runs.items():
                results[name].append(await _measure(run, ns.seconds))
    leg.close()
    return results


def main() -> int:
    """Start the simulator, run both clients, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=16)
    ns = parser.parse_args()
    cores = Cores.choose(pin=True)
    if cores.proxy is not None:
        os.sched_setaffinity(0, {int(cores.proxy)})
    with tempfile.TemporaryDirectory(prefix="cw-client-leg-") as tmp:
        sim = start_simulator(cores.rest, Path(tmp))
        try:
            results = uvloop.run(_rounds(int(sim.url.rsplit(":", 1)[1]), ns))
        finally:
            sim.stop()
    print(
        f"upstream leg alone, CPU µs per request of the client process (c={ns.concurrency}, "
        f"{ns.rounds} × {ns.seconds:g} s, client on core {cores.proxy}, simulator on core {cores.rest})\n"
    )
    print("| client | " + " | ".join(f"round {i + 1}" for i in range(ns.rounds)) + " | median |")
    print("|---|" + "---:|" * (ns.rounds + 1))
    for name, values in results.items():
        print(
            f"| {name} | " + " | ".join(f"{v:.0f}" for v in values) + f" | {statistics.median(values):.0f} |"
        )
    session, ours, bare = (statistics.median(v) for v in results.values())
    print(
        f"\nthe sidecar's leg costs {session - ours:.0f} µs less per request than ClientSession "
        f"({100 * (session - ours) / session:.0f} %), {ours - bare:.0f} µs more than the bare client"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
