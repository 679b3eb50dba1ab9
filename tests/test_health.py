"""/-/healthy is liveness; /-/ready follows the upstream's health probe, or its answers to traffic."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from tests.support.client import CLIENT_TIMEOUT
from tests.support.process import wait_status
from tests.support.sidecar import SidecarFactory, free_port, serve_app
from tests.support.upstream import build_upstream


async def test_healthy_answers_even_when_upstream_is_down(sidecar: SidecarFactory) -> None:
    proxy = await sidecar(f"http://127.0.0.1:{free_port()}")
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session,
        session.get(proxy + "/-/healthy") as response,
    ):
        assert response.status == 200


async def test_ready_once_upstream_answers_its_health_probe(sidecar: SidecarFactory) -> None:
    async with serve_app(build_upstream()) as upstream:
        proxy = await sidecar(upstream)
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            await wait_status(session, proxy + "/-/ready", 200)


async def test_not_ready_while_upstream_is_down(sidecar: SidecarFactory) -> None:
    proxy = await sidecar(f"http://127.0.0.1:{free_port()}")
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session,
        session.get(proxy + "/-/ready") as response,
    ):
        assert response.status == 503
        assert (await response.json())["status"] == "upstream_down"


async def test_ready_turns_503_when_upstream_goes_away(sidecar: SidecarFactory) -> None:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        async with serve_app(build_upstream()) as upstream:
            proxy = await sidecar(upstream)
            await wait_status(session, proxy + "/-/ready", 200)
        await wait_status(session, proxy + "/-/ready", 503)


def _engine(status: int, hits: list[int]) -> web.Application:
    """An engine whose completions answer `status`, counting the probes of its health path in `hits`."""

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "chatcmpl-1"}, status=status)

    async def health(request: web.Request) -> web.Response:
        hits[0] += 1
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    return app


@contextlib.asynccontextmanager
async def _ready_sidecar(
    sidecar: SidecarFactory, status: int
) -> AsyncIterator[tuple[aiohttp.ClientSession, str, list[int]]]:
    """A ready sidecar (probing every 0.4 s) before an engine answering `status`: a client
    session, the sidecar's URL, and the engine's count of probes."""
    hits = [0]
    async with serve_app(_engine(status, hits)) as engine:
        proxy = await sidecar(engine, engine="vllm", health_interval=0.4)
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            await wait_status(session, proxy + "/-/ready", 200)
            yield session, proxy, hits


async def _probes_while(session: aiohttp.ClientSession, proxy: str, hits: list[int], *, traffic: bool) -> int:
    """The engine's health probes over 2 s, with a request every 20 ms (traffic) or none."""
    before = hits[0]
    for _ in range(100):
        if traffic:
            async with session.post(proxy + "/v1/chat/completions", json={"model": "m", "messages": []}) as r:
                await r.read()
        await asyncio.sleep(0.02)
    return hits[0] - before


async def test_answered_traffic_stands_in_for_the_health_probe(sidecar: SidecarFactory) -> None:
    """While the engine answers requests, it is not probed as well; once they stop, probes resume."""
    async with _ready_sidecar(sidecar, 200) as (session, proxy, hits):
        during = await _probes_while(session, proxy, hits, traffic=True)
        async with session.get(proxy + "/-/ready") as response:
            assert response.status == 200  # answers keep it ready without probes
        after = await _probes_while(session, proxy, hits, traffic=False)
    # About 5 intervals each: probed in none of those with answers (a boundary's one, and one
    # after a stall of the loaded machine, allowed), in most of those without.
    assert during <= 2, f"{during} probes while the engine answered traffic"
    assert after >= 3, f"only {after} probes after the traffic stopped"


async def test_answers_of_500_do_not_stand_in_for_the_probe(sidecar: SidecarFactory) -> None:
    """An engine answering 5xx is probed as if idle: only an answer below 500 says it serves."""
    async with _ready_sidecar(sidecar, 500) as (session, proxy, hits):
        during = await _probes_while(session, proxy, hits, traffic=True)
    assert during >= 3, f"only {during} probes while every answer was a 500"
