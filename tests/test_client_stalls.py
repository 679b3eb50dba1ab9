"""Clients that stop reading their answer (issue 27, M8), through `python -m proxy serve` and the simulator."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from yarl import URL

from proxy.upstream.response import HIGH_WATER
from tests.support.metrics import Scrape
from tests.support.process import start_sidecar, stop
from tests.support.sim import WAIT_S, Sim, fast, sim

# Far more than the kernel's buffers and the relay's hold: the sidecar ends up waiting on the client.
LONG_STREAM = {
    "model": "sim-model",
    "messages": [{"role": "user", "content": "a long answer"}],
    "max_tokens": 100_000,
    "stream": True,
}
TINY_RCVBUF = 4096


def stalling_client(url: str, body: dict[str, Any], session_id: str) -> socket.socket:
    """A client with a tiny receive buffer that sends its request and then reads nothing."""
    target = URL(url)
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TINY_RCVBUF)  # before connect: it sets the window
    client.settimeout(WAIT_S)
    client.connect((target.host, target.port))
    data = orjson.dumps(body)
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
        b"X-Session-Id: " + session_id.encode() + b"\r\n"
        b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
    )
    return client


async def scrape(http: aiohttp.ClientSession, proxy: str) -> Scrape:
    """GET /metrics."""
    async with http.get(proxy + "/metrics") as response:
        return Scrape(await response.text())


async def wait_metric(
    http: aiohttp.ClientSession, proxy: str, name: str, at_least: float, **labels: str
) -> None:
    """Poll /metrics until a sample reaches `at_least` (bounded by WAIT_S)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while (value := (await scrape(http, proxy)).value(name, **labels)) < at_least:
        assert loop.time() < deadline, f"{name}{labels} stayed at {value}"
        await asyncio.sleep(0.05)


async def session_records(http: aiohttp.ClientSession, proxy: str, session_id: str) -> list[dict[str, Any]]:
    """The evidence records of one session."""
    async with http.get(proxy + "/cache/evidence", params={"session_id": session_id}) as response:
        return [orjson.loads(line) for line in (await response.read()).splitlines()]


async def test_a_client_that_stops_reading_is_cut_and_does_not_hold_a_reset(tmp_path: Path) -> None:
    """A client that reads nothing of a long stream: what the relay holds for it counts in the body
    budget; a reset started meanwhile waits for it only until client_write_timeout cuts it (not for
    the whole drain_timeout); the engine sees its request aborted; the record says client_stalled."""
    async with sim(fast("vllm")) as engine:
        process, proxy = await start_sidecar(
            engine.url, tmp_path, "--client-write-timeout", "4", "--drain-timeout", "60"
        )
        client = stalling_client(proxy, LONG_STREAM, "stall")
        try:
            http = engine.http
            # The relay waits on the client: what it holds for it (past HIGH_WATER) is in the budget.
            await wait_metric(http, proxy, "cachewitness_buffered_request_bytes", HIGH_WATER)
            async with http.post(proxy + "/cache/reset", json={"verify": "none"}) as response:
                assert response.status == 200, await response.text()
                reset = await response.json()
            result = await scrape(http, proxy)
            stats = await engine.wait_stats(lambda s: s["running"] == 0)
            records = await session_records(http, proxy, "stall")
        finally:
            client.close()
            await stop(process)
    # The reset found the stalled request in flight, and the cut ended its drain.
    assert (reset["drain"]["inflight_at_start"], reset["drain"]["inflight_at_end"]) == (1, 0), reset["drain"]
    assert reset["drain"]["waited_s"] < 60
    assert result.value("cachewitness_connection_limit_hits_total", limit="client_write_timeout") == 1
    assert result.value("cachewitness_buffered_request_bytes") == 0
    assert (stats["aborted_total"], stats["completed_total"]) == (1, 0)
    (observation,) = [r for r in records if r["event_type"] == "infer.cache_observation"]
    assert (observation["status"], observation["outcome"]) == (200, "client_stalled")


async def read_slowly(client: socket.socket, seconds: float) -> int:
    """Take 1 KiB every 0.1 s for `seconds` (far slower than the stream comes); the bytes taken."""
    client.setblocking(False)
    loop = asyncio.get_running_loop()
    taken = 0
    for _ in range(int(seconds / 0.1)):
        await asyncio.sleep(0.1)  # the pace is the behaviour under test
        taken += len(await asyncio.wait_for(loop.sock_recv(client, 1024), timeout=WAIT_S))
    return taken


async def test_a_slow_client_that_keeps_reading_is_not_cut(tmp_path: Path) -> None:
    """client_write_timeout is a client taking nothing, not the sidecar waiting: a client that reads
    1 KiB every 0.1 s for 5 s (the relay waits on it all along) passes a 2 s limit and gets it all.

    The kernel takes the client's pace in steps of a few KiB (its window), so the limit here is
    a few such steps; the sidecar sees them in its socket's send queue."""
    stream = {**LONG_STREAM, "max_tokens": 20_000}
    async with sim(fast("vllm")) as engine:
        process, proxy = await start_sidecar(engine.url, tmp_path, "--client-write-timeout", "2")
        client = stalling_client(proxy, stream, "slow")
        try:
            http = engine.http
            await wait_metric(http, proxy, "cachewitness_buffered_request_bytes", HIGH_WATER)
            assert await read_slowly(client, 5.0) > 0
            # The rest at full speed, to the chunked stream's end (the connection stays open).
            rest = await read_until_done(client)
            result = await scrape(http, proxy)
            stats = await completed(engine)
        finally:
            client.close()
            await stop(process)
    assert b"data: [DONE]\n\n" in rest[-64:], rest[-80:]
    assert result.value("cachewitness_connection_limit_hits_total", limit="client_write_timeout") == 0
    assert stats["completed_total"] == 1


async def read_until_done(client: socket.socket) -> bytes:
    """Read until the chunked SSE stream's last chunk (bounded)."""
    loop = asyncio.get_running_loop()
    data = bytearray()
    while not data.endswith(b"0\r\n\r\n"):
        chunk = await asyncio.wait_for(loop.sock_recv(client, 1 << 20), timeout=WAIT_S)
        assert chunk, "the sidecar closed the connection before the end of the stream"
        data += chunk
    return bytes(data)


async def completed(engine: Sim) -> dict[str, Any]:
    """The simulator's stats once its one request completed."""
    return await engine.wait_stats(lambda s: s["completed_total"] == 1)
