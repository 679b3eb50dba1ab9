"""vLLM with LMCache behind `python -m proxy serve --lmcache-api ...`: each reset also clears LMCache on every
worker, each call in `calls`, and `verification.tiers.external` says what the canary and `lmcache:num_hit_tokens` saw."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.sim import running_sim
from tests.support.client import CLIENT_TIMEOUT
from tests.support.ports import fixed_ports
from tests.support.process import start_sidecar, stop
from tests.support.sidecar import closed_port_url
from tests.support.sim import fast

WORKERS = 2


@asynccontextmanager
async def served(
    tmp_path: Path, *, apis: str | None = None, port_start: int | None = None, **options: Any
) -> AsyncIterator[tuple[str, aiohttp.ClientSession, list[str]]]:
    """vLLM with LMCache (scheduler + two workers' API servers) and the sidecar told where they are."""
    start = port_start if port_start is not None else fixed_ports(WORKERS + 1)
    servers = [f"http://127.0.0.1:{start + offset}" for offset in range(WORKERS + 1)]
    config = fast("vllm", lmcache=True, lmcache_port_start=start, lmcache_workers=WORKERS, **options)
    async with running_sim(config) as engine:
        process, sidecar = await start_sidecar(engine, tmp_path, "--lmcache-api", apis or ",".join(servers))
        try:
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
                yield sidecar, http, servers
        finally:
            await stop(process)


async def reset(http: aiohttp.ClientSession, sidecar: str) -> tuple[int, dict[str, Any]]:
    """POST /cache/reset with the canary."""
    async with http.post(sidecar + "/cache/reset", json={}) as resp:
        return resp.status, await resp.json()


def clears(body: dict[str, Any]) -> list[tuple[str, int | None]]:
    """The answer's LMCache calls: (URL, status)."""
    return [(c["url"], c["status"]) for c in body["calls"] if c["url"].endswith("/cache/clear")]


async def test_every_worker_is_cleared_and_the_external_tier_proven_cold(tmp_path: Path) -> None:
    async with served(tmp_path) as (sidecar, http, servers):
        status, body = await reset(http, sidecar)
    assert (status, body["answer"], body["verified"]) == (200, "acknowledged", "verified"), body
    # The scheduler's server holds no cache engine (503), each worker's answers success.
    expected = [(servers[0] + "/cache/clear", 503)] + [(s + "/cache/clear", 200) for s in servers[1:]]
    # Every reset the canary makes clears LMCache too; the last reset's calls close the list.
    assert clears(body)[-3:] == expected
    assert body["verification"]["tiers"]["external"] == "cleared"


async def test_a_success_that_removed_nothing_is_contradicted_with_the_tier_named(tmp_path: Path) -> None:
    async with served(tmp_path, lmcache_leaves_warm=True) as (sidecar, http, servers):
        status, body = await reset(http, sidecar)
    assert (status, body["answer"], body["success"]) == (502, "contradicted", False), body
    assert body["cache_state"]["reset"]["answer"] == "acknowledged"
    assert body["verification"]["tiers"]["external"] == "warm"
    assert body["verification"]["tiers"]["device"] == "cleared"
    assert "external tier (LMCache)" in body["verification"]["reason"]
    assert "LMCache answered success at " + servers[1] in body["hint"]


async def test_a_server_that_cannot_be_reached_leaves_the_tier_unknown_and_says_so(tmp_path: Path) -> None:
    start = fixed_ports(WORKERS + 1)
    dead = closed_port_url()
    apis = f"http://127.0.0.1:{start + 1},{dead}"
    async with served(tmp_path, apis=apis, port_start=start) as (sidecar, http, _servers):
        status, body = await reset(http, sidecar)
    assert status == 200, body
    assert body["verification"]["tiers"]["external"] == "unknown"
    assert f"LMCache did not clear its tiers at {dead}" in body["warning"]


def _free(ports: range) -> bool:
    """Whether every port can be bound on loopback now."""
    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


async def test_auto_finds_the_servers_on_lmcaches_default_ports(tmp_path: Path) -> None:
    if not _free(range(6999, 6999 + WORKERS + 1)):
        pytest.skip("LMCache's default ports 6999.. are taken on this machine")
    async with served(tmp_path, apis="auto", port_start=6999) as (sidecar, http, servers):
        status, body = await reset(http, sidecar)
    assert (status, body["verification"]["tiers"]["external"]) == (200, "cleared"), body
    assert [url for url, _ in clears(body)[-3:]] == [s + "/cache/clear" for s in servers]
