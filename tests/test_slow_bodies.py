"""Slow bodies and one peer's connections (issue 45, M5), through `python -m proxy serve`.

A body that keeps coming, one byte at a time, passes body_idle_timeout for ever: body_timeout
bounds its whole time. One address cannot hold more than max_connections_per_peer slots. The
connections held receiving bodies are a gauge the chart's CachewitnessSlowBodies alert reads.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from proxy.sim import running_sim
from tests.support.client import CLIENT_TIMEOUT
from tests.support.process import BOUND_S, open_raw, read_until_closed, scrape_fresh, start_sidecar, stop
from tests.support.sim import chat, fast

# Taken by the front (a plain target), and by aiohttp (a query): both read bodies under the same limits.
_TARGETS = ["/v1/chat/completions", "/v1/chat/completions", "/v1/chat/completions?x=1"]


def _head(target: str, length: int = 1000) -> bytes:
    return (
        f"POST {target} HTTP/1.1\r\nHost: s\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def _trickle(writer: asyncio.StreamWriter) -> None:
    """A byte every 0.3 s (never silent for body_idle_timeout) until the sidecar closes the connection."""
    try:
        for _ in range(200):
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.3)
    except ConnectionError:
        return


async def _chat_ok(url: str) -> None:
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session,
        session.post(url + "/v1/chat/completions", json=chat("served beside them")) as response,
    ):
        assert response.status == 200


async def test_a_body_that_trickles_is_closed_at_body_timeout_and_counted(tmp_path: Path) -> None:
    """Three bodies trickling a byte every 0.3 s (body_idle_timeout 1 s never fires): counted as
    receiving while they come, closed at body_timeout (2 s), each hit counted; others are served."""
    async with running_sim(fast("vllm")) as engine:
        process, url = await start_sidecar(
            engine, tmp_path, "--body-idle-timeout", "1", "--body-timeout", "2", "--header-timeout", "5"
        )
        try:
            connections = [await open_raw(url, _head(target)) for target in _TARGETS]
            trickles = [asyncio.create_task(_trickle(writer)) for _, writer in connections]
            await asyncio.sleep(0.6)
            during = await scrape_fresh(url)
            await _chat_ok(url)
            closed = await asyncio.wait_for(
                asyncio.gather(*(read_until_closed(connection) for connection in connections)), BOUND_S
            )
            await asyncio.wait_for(asyncio.gather(*trickles), BOUND_S)
            after = await scrape_fresh(url)
        finally:
            await stop(process)
    assert during.value("cachewitness_client_connections_receiving_body") == len(_TARGETS)
    assert closed == [b""] * len(_TARGETS)  # closed mid-body: no answer to give
    assert after.value("cachewitness_connection_limit_hits_total", limit="body_timeout") == len(_TARGETS)
    assert after.value("cachewitness_connection_limit_hits_total", limit="body_idle_timeout") == 0
    assert after.value("cachewitness_client_connections_receiving_body") == 0
    assert '"limit":"body_timeout"' in (tmp_path / "sidecar.log").read_text()


async def test_a_body_gone_silent_is_closed_with_no_header_timeout_to_wake_the_check(tmp_path: Path) -> None:
    """With header_timeout off, body_idle_timeout alone must close a connection whose body stopped
    after its head: the front arms the body's own deadline when the body is not all in hand with
    its head (issue 50 skips it only for a body that is), aiohttp's guard when its head is read."""
    async with running_sim(fast("vllm")) as engine:
        process, url = await start_sidecar(
            engine, tmp_path, "--body-idle-timeout", "1", "--body-timeout", "0", "--header-timeout", "0"
        )
        try:
            # The front's target with a part of its body, then silence; aiohttp's with none of it.
            front = await open_raw(url, _head(_TARGETS[0]) + b'{"model":')
            handed_off = await open_raw(url, _head(_TARGETS[2]))
            closed = await asyncio.wait_for(
                asyncio.gather(read_until_closed(front), read_until_closed(handed_off)), BOUND_S
            )
            await _chat_ok(url)
            after = await scrape_fresh(url)
        finally:
            await stop(process)
    assert list(closed) == [b"", b""]
    assert after.value("cachewitness_connection_limit_hits_total", limit="body_idle_timeout") == 2


async def _open_from(url: str, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port), local_addr=(source, 0))


async def test_one_address_holds_at_most_max_connections_per_peer(tmp_path: Path) -> None:
    """With max_connections_per_peer 3: a 4th connection from 127.0.0.1 gets 503 and is closed while
    another address is served; once one of the three closes, 127.0.0.1 is let in again."""
    async with running_sim(fast("vllm")) as engine:
        process, url = await start_sidecar(engine, tmp_path, "--max-connections-per-peer", "3")
        try:
            held = [await _open_from(url, "127.0.0.1") for _ in range(3)]
            await asyncio.sleep(0.2)  # all three let in
            fourth = await _open_from(url, "127.0.0.1")
            refused = await read_until_closed(fourth)
            other = await _open_from(url, "127.0.0.2")
            other[1].write(b"GET /-/healthy HTTP/1.1\r\nHost: s\r\nConnection: close\r\n\r\n")
            other_answer = await read_until_closed(other)
            held.pop()[1].close()
            await asyncio.sleep(0.2)  # its slot is given back
            again = await _open_from(url, "127.0.0.1")
            again[1].write(b"GET /-/healthy HTTP/1.1\r\nHost: s\r\nConnection: close\r\n\r\n")
            again_answer = await read_until_closed(again)
            for _, writer in held:
                writer.close()
            result = await scrape_fresh(url)
        finally:
            await stop(process)
    assert refused.startswith(b"HTTP/1.1 503 "), refused
    assert b"max_connections_per_peer" in refused
    assert other_answer.startswith(b"HTTP/1.1 200 "), other_answer
    assert again_answer.startswith(b"HTTP/1.1 200 "), again_answer
    assert result.value("cachewitness_connection_limit_hits_total", limit="max_connections_per_peer") == 1
