"""Idle keep-alive connections cannot lock the pod's probes out (issue 27, M1), through `python -m proxy serve`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from proxy.inbound import PROBE_SLOTS
from proxy.sim import running_sim
from tests.support.process import BOUND_S, open_raw, read_until_closed, start_sidecar, stop
from tests.support.sidecar import free_port
from tests.support.sim import fast

PROBE = b"GET /-/healthy HTTP/1.1\r\nHost: sidecar\r\n\r\n"
MAX_CONNECTIONS = 4


async def idle_keepalive(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that made one request, read its answer whole, and stays open, idle (keep-alive)."""
    reader, writer = await open_raw(url, PROBE)
    answer = await asyncio.wait_for(reader.readuntil(b"}"), timeout=BOUND_S)
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    return reader, writer


async def get(url: str) -> tuple[int, bytes]:
    """GET on a fresh connection: the status and body."""
    timeout = aiohttp.ClientTimeout(total=BOUND_S)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
        return response.status, await response.read()


async def test_an_idle_keepalive_connection_is_closed_after_keepalive_timeout(tmp_path: Path) -> None:
    """A client that made one request and then stays idle is closed at keepalive_timeout (aiohttp: 3,630 s)."""
    async with running_sim(fast("vllm")) as engine:
        process, proxy = await start_sidecar(engine, tmp_path, "--keepalive-timeout", "1")
        try:
            # read_until_closed fails (after BOUND_S) if the sidecar never closes the connection.
            answer = await read_until_closed(await open_raw(proxy, PROBE))
        finally:
            await stop(process)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"status": "ok"}'), answer


async def test_probe_listener_answers_while_every_client_slot_is_held(tmp_path: Path) -> None:
    """max_connections idle keep-alive connections, and the probe slots past them, all held: the main
    listener refuses everyone, and health_listen still answers both probes (and serves nothing else)."""
    probe_port = free_port()
    async with running_sim(fast("vllm")) as engine:
        process, proxy = await start_sidecar(
            engine,
            tmp_path,
            "--max-connections",
            str(MAX_CONNECTIONS),
            "--header-timeout",
            "60",
            "--health-listen",
            f"127.0.0.1:{probe_port}",
        )
        probes = f"http://127.0.0.1:{probe_port}"
        try:
            held = [await idle_keepalive(proxy) for _ in range(MAX_CONNECTIONS)]
            held += [await open_raw(proxy, b"") for _ in range(PROBE_SLOTS)]  # silent: the probe slots
            refused = await read_until_closed(await open_raw(proxy, b""))
            answers = [await get(probes + path) for path in ("/-/healthy", "/-/ready", "/v1/models")]
            for _, writer in held:
                writer.close()
        finally:
            await stop(process)
    assert refused.startswith(b"HTTP/1.1 503 ") and b'"code":"too_many_connections"' in refused, refused
    assert answers[0] == (200, b'{"status": "ok"}')
    assert answers[1] == (200, b'{"status": "ready"}')
    assert answers[2][0] == 404  # the probe listener forwards nothing to the engine


async def test_probe_slots_answer_probes_past_max_connections(tmp_path: Path) -> None:
    """Without health_listen: once idle keep-alive connections hold every slot, a probe still gets its
    answer on the main listener (then the connection closes), and any other request gets 503."""
    async with running_sim(fast("vllm")) as engine:
        process, proxy = await start_sidecar(engine, tmp_path, "--max-connections", str(MAX_CONNECTIONS))
        try:
            held = [await idle_keepalive(proxy) for _ in range(MAX_CONNECTIONS)]
            ready = await read_until_closed(
                await open_raw(proxy, b"GET /-/ready HTTP/1.1\r\nHost: sidecar\r\n\r\n")
            )
            other = await read_until_closed(
                await open_raw(proxy, b"GET /v1/models HTTP/1.1\r\nHost: sidecar\r\n\r\n")
            )
            for _, writer in held:
                writer.close()
        finally:
            await stop(process)
    assert ready.startswith(b"HTTP/1.1 200 ") and ready.endswith(b'{"status": "ready"}'), ready
    assert b"\r\nConnection: close\r\n" in ready
    assert other.startswith(b"HTTP/1.1 503 ") and b'"code":"too_many_connections"' in other, other
