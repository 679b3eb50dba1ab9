"""SIGTERM: not ready at once, in-flight streams finish, new connections stop, exit 0."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp
import pytest

from tests.support.client import CLIENT_TIMEOUT
from tests.support.process import start_sidecar, wait_status
from tests.support.sidecar import serve_app
from tests.support.upstream import STATE, build_upstream


async def refused_within(url: str, bound_s: float) -> bool:
    """Poll `url` until a connection is refused (True) or the bound passes (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        while loop.time() < deadline:
            try:
                async with session.get(url) as response:
                    await response.read()
            except aiohttp.ClientConnectionError:
                return True
            await asyncio.sleep(0.05)
    return False


async def test_sigterm_lets_streams_finish_and_exits_0(tmp_path: Path) -> None:
    upstream_app = build_upstream()
    state = upstream_app[STATE]
    async with serve_app(upstream_app) as upstream, aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        process, proxy = await start_sidecar(
            upstream, tmp_path, "--shutdown-delay", "0.5", "--grace-period", "20"
        )
        stream = await session.get(proxy + "/sse/paced?n=3")
        state.gates[0].set()
        assert await stream.content.readuntil(b"\n\n") == b'data: {"i": 0}\n\n'
        process.send_signal(signal.SIGTERM)
        # During shutdown_delay the sidecar still answers, but says it is not ready.
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as probe:
            await wait_status(probe, proxy + "/-/ready", 503, bound_s=5)
        # Once shutdown_delay is over the listener closes: new connections are refused.
        assert await refused_within(proxy + "/-/healthy", bound_s=5)
        state.gates[1].set()
        state.gates[2].set()
        rest = await asyncio.wait_for(stream.content.read(), timeout=10)
        assert rest == b'data: {"i": 1}\n\ndata: {"i": 2}\n\ndata: [DONE]\n\n'
        stream.close()
        assert await asyncio.wait_for(process.wait(), timeout=20) == 0


async def test_sigterm_with_nothing_in_flight_exits_0_quickly(tmp_path: Path) -> None:
    async with serve_app(build_upstream()) as upstream:
        process, _ = await start_sidecar(upstream, tmp_path)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=10) == 0


async def test_sigterm_loses_no_buffered_evidence(tmp_path: Path) -> None:
    from proxy.sim import running_sim
    from tests.support.sim import chat, fast

    async with running_sim(fast("vllm")) as engine, aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        process, proxy = await start_sidecar(engine, tmp_path)
        for index in range(200):
            async with session.post(proxy + "/v1/chat/completions", json=chat(f"prompt {index}")) as response:
                assert response.status == 200
        # Straight after the last answer: records still sit in the writer's batch.
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=20) == 0
    lines = (tmp_path / "ev.jsonl").read_bytes().splitlines()
    assert sum(b'"event_type":"infer.cache_observation"' in line for line in lines) == 200


async def test_sigterm_cuts_a_stream_at_the_grace_period(tmp_path: Path) -> None:
    """A stream still running when grace_period runs out is cut then, within 0.5 s, and exit is 0."""
    upstream_app = build_upstream()
    state = upstream_app[STATE]
    async with serve_app(upstream_app) as upstream, aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        process, proxy = await start_sidecar(upstream, tmp_path, "--grace-period", "3")
        stream = await session.get(proxy + "/sse/paced?n=3")
        state.gates[0].set()
        assert await stream.content.readuntil(b"\n\n") == b'data: {"i": 0}\n\n'
        loop = asyncio.get_running_loop()
        signalled_at = loop.time()
        process.send_signal(signal.SIGTERM)
        with pytest.raises(aiohttp.ClientError):
            await asyncio.wait_for(stream.content.read(), timeout=20)
        cut_after = loop.time() - signalled_at
        stream.close()
        assert await asyncio.wait_for(process.wait(), timeout=20) == 0
    assert 3.0 <= cut_after <= 3.5, cut_after
