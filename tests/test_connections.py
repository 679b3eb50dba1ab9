"""Client connection limits (issue 16 item 4), through `python -m proxy serve`, the production runner."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import orjson

from proxy.inbound import PROBE_SLOTS
from proxy.sim import running_sim
from tests.support.client import CLIENT_TIMEOUT
from tests.support.process import open_raw, read_until_closed, scrape_fresh, start_sidecar, stop
from tests.support.sim import chat, fast

HALF_OPEN = {
    "nothing": b"",
    "half a request line": b"POST /v1/chat/compl",
    "headers without the final CRLF": b"GET /-/healthy HTTP/1.1\r\nHost: sidecar\r\n",
}


async def test_idle_half_open_connections_are_closed(tmp_path: Path) -> None:
    """Nothing, half a request line, an unfinished head, a stopped body: each closed, counted, logged."""
    async with running_sim(fast("vllm")) as engine:
        process, proxy = await start_sidecar(
            engine, tmp_path, "--header-timeout", "1", "--body-idle-timeout", "1"
        )
        try:
            heads = [await open_raw(proxy, payload) for payload in HALF_OPEN.values()]
            stopped_body = await open_raw(
                proxy,
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model":',
            )
            answers = [await read_until_closed(connection) for connection in heads]
            assert await read_until_closed(stopped_body) == b""
            result = await scrape_fresh(proxy)
        finally:
            await stop(process)
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), answers
    assert result.value("cachewitness_connection_limit_hits_total", limit="header_timeout") == 3
    assert result.value("cachewitness_connection_limit_hits_total", limit="body_idle_timeout") == 1
    log = (tmp_path / "sidecar.log").read_text()
    assert '"limit":"header_timeout"' in log and '"limit":"body_idle_timeout"' in log


async def test_a_slow_body_that_keeps_coming_is_not_cut(tmp_path: Path) -> None:
    """body_idle_timeout is silence, not total time: a body trickling for 3 s passes a 1 s limit."""
    body = orjson.dumps(chat("a slow upload"))
    pieces = [body[i : i + len(body) // 6 + 1] for i in range(0, len(body), len(body) // 6 + 1)]
    async with running_sim(fast("vllm")) as engine:
        process, proxy = await start_sidecar(
            engine, tmp_path, "--header-timeout", "1", "--body-idle-timeout", "1"
        )
        try:
            connection = await open_raw(
                proxy,
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n",
            )
            for piece in pieces:
                await asyncio.sleep(0.5)  # the pacing is the behaviour under test
                connection[1].write(piece)
                await connection[1].drain()
            answer = await read_until_closed(connection)
        finally:
            await stop(process)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


async def test_normal_requests_keep_working_under_the_fd_limit(tmp_path: Path) -> None:
    """300 idle connections against a 256-descriptor sidecar: past max_connections they get a clear
    503 and close, the rest close at header_timeout, and normal requests are answered throughout."""
    async with running_sim(fast("vllm")) as engine:
        process, proxy = await start_sidecar(
            engine,
            tmp_path,
            "--max-connections",
            "64",
            "--header-timeout",
            "2",
            nofile=256,
        )
        try:
            connector = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT, connector=connector) as client:
                # A client with a keep-alive connection open before the flood.
                async with client.post(proxy + "/v1/chat/completions", json=chat("before")) as response:
                    assert response.status == 200
                    await response.read()  # read whole, the connection goes back to the pool
                idle = [await open_raw(proxy, b"") for _ in range(300)]
                # While the flood holds every slot, the established client is still served (the
                # sidecar has descriptors left for its upstream connections).
                for index in range(10):
                    async with client.post(
                        proxy + "/v1/chat/completions", json=chat(f"during {index}")
                    ) as response:
                        assert response.status == 200
                        await response.read()
            answers = await asyncio.gather(*(read_until_closed(connection) for connection in idle))
            refused = [answer for answer in answers if answer.startswith(b"HTTP/1.1 503 ")]
            timed_out = [answer for answer in answers if answer.startswith(b"HTTP/1.1 408 ")]
            assert b'"code":"too_many_connections"' in refused[0]
            # The idle ones are gone: new clients on new connections are served.
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as fresh:
                for index in range(10):
                    async with fresh.post(
                        proxy + "/v1/chat/completions", json=chat(f"after {index}")
                    ) as response:
                        assert response.status == 200
            result = await scrape_fresh(proxy)
        finally:
            await stop(process)
    # 64 slots: one was the client's, 63 went to the flood, and so did the probe slots past them
    # (a connection that sends nothing is timed out there too); the rest were refused.
    flood_held = 63 + PROBE_SLOTS
    assert (len(timed_out), len(refused)) == (flood_held, 300 - flood_held)
    assert (
        result.value("cachewitness_connection_limit_hits_total", limit="max_connections") == 300 - flood_held
    )
    assert result.value("cachewitness_connection_limit_hits_total", limit="header_timeout") == flood_held
