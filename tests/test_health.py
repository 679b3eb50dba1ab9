"""/-/healthy is liveness; /-/ready follows the upstream's health probe."""

from __future__ import annotations

import aiohttp

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
