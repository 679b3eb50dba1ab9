"""TensorRT-LLM and Dynamo behind `python -m proxy serve --engine auto`: detected, and every reset answered
as the engine's body says: acknowledged, refused (Dynamo: partial), unsupported, and contradicted by the canary."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.sim import SimConfig, running_sim
from tests.support.client import CLIENT_TIMEOUT
from tests.support.process import start_sidecar, stop
from tests.support.sim import chat, fast, slow, words

VERSIONS = {"trtllm": "1.3.0rc29", "dynamo": None}
RESET_PATHS = {"trtllm": "/reset_prefix_cache", "dynamo": "/clear_kv_blocks"}


@asynccontextmanager
async def served(config: SimConfig, tmp_path: Path) -> AsyncIterator[tuple[str, str, aiohttp.ClientSession]]:
    """The simulated engine, `python -m proxy serve --engine auto` in front of it, and a client."""
    async with running_sim(config) as engine:
        process, sidecar = await start_sidecar(engine, tmp_path, "--engine", "auto")
        try:
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
                yield engine, sidecar, http
        finally:
            await stop(process)


async def reset(http: aiohttp.ClientSession, sidecar: str, **body: Any) -> tuple[int, dict[str, Any]]:
    """POST /cache/reset."""
    async with http.post(sidecar + "/cache/reset", json=body) as resp:
        return resp.status, await resp.json()


@asynccontextmanager
async def busy(http: aiohttp.ClientSession, engine: str) -> AsyncIterator[None]:
    """A long request generating at the engine itself for the whole block."""
    task = asyncio.create_task(http.post(engine + "/v1/chat/completions", json=chat(words(20), 5000)))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:
        async with http.get(engine + "/sim/stats") as resp:
            if (await resp.json())["running"] >= 1:
                break
        assert loop.time() < deadline, "the long request never ran"
        await asyncio.sleep(0.01)
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("dialect", ["trtllm", "dynamo"])
async def test_an_idle_engine_is_detected_and_acknowledged_and_verified(dialect: str, tmp_path: Path) -> None:
    async with served(fast(dialect), tmp_path) as (_engine, sidecar, http):
        status, body = await reset(http, sidecar)
    assert (status, body["answer"], body["success"]) == (200, "acknowledged", True), body
    assert body["engine"] == {"kind": dialect, "version": VERSIONS[dialect]}
    assert body["verified"] == "verified", body["verification"]
    assert any(call["url"].endswith(RESET_PATHS[dialect]) for call in body["calls"])
    # The engine's own counters (TensorRT-LLM's at /prometheus/metrics) saw only the canary.
    assert body["verification"]["witnesses"]["counters"]["result"] == "consistent"


async def test_dynamo_two_workers_both_cleared_is_acknowledged(tmp_path: Path) -> None:
    async with served(fast("dynamo", dp_size=2), tmp_path) as (_engine, sidecar, http):
        status, body = await reset(http, sidecar)
    assert (status, body["answer"]) == (200, "acknowledged"), body


@pytest.mark.parametrize("dialect", ["trtllm", "dynamo"])
async def test_a_busy_engine_is_refused(dialect: str, tmp_path: Path) -> None:
    async with served(slow(dialect), tmp_path) as (engine, sidecar, http), busy(http, engine):
        status, body = await reset(http, sidecar, drain=False, retry_seconds=0)
    assert (status, body["answer"], body["success"]) == (409, "refused", False), body
    if dialect == "dynamo":
        # HTTP 200 from the frontend, the worker's "status": "error" inside the body.
        assert body["cache_state"]["reset"]["status"] == 200
        assert "1 refused (dynamo/backend-instance-1)" in body["cache_state"]["reset"]["error"]


async def test_dynamo_a_worker_not_reached_is_a_partial_refusal(tmp_path: Path) -> None:
    config = fast("dynamo", dp_size=2, unreachable_worker=1)
    async with served(config, tmp_path) as (_engine, sidecar, http):
        status, body = await reset(http, sidecar, retry_seconds=0)
    assert (status, body["answer"], body["success"]) == (409, "refused", False), body
    error = body["cache_state"]["reset"]["error"]
    assert "partial: 1 of 2 workers cleared" in error and "not reached (dynamo/backend-instance-2)" in error


@pytest.mark.parametrize(
    ("dialect", "route"), [("trtllm", "/reset_prefix_cache"), ("dynamo", "/clear_kv_blocks")]
)
async def test_an_engine_without_the_route_is_unsupported_with_a_hint(
    dialect: str, route: str, tmp_path: Path
) -> None:
    async with served(fast(dialect, reset_route=False), tmp_path) as (_engine, sidecar, http):
        status, body = await reset(http, sidecar)
    assert (status, body["answer"], body["success"]) == (501, "unsupported", False), body
    assert route in body["hint"]


@pytest.mark.parametrize("dialect", ["trtllm", "dynamo"])
async def test_a_success_the_canary_contradicts_is_contradicted(dialect: str, tmp_path: Path) -> None:
    async with served(fast(dialect, reset_leaves_warm=True), tmp_path) as (_engine, sidecar, http):
        status, body = await reset(http, sidecar)
    assert (status, body["answer"], body["success"]) == (502, "contradicted", False), body
    assert body["cache_state"]["reset"]["answer"] == "acknowledged"
    assert body["verified"] == "contradicted"


async def test_trtllm_cached_tokens_and_prometheus_text_reach_the_sidecar(tmp_path: Path) -> None:
    async with served(fast("trtllm"), tmp_path) as (_engine, sidecar, http):
        for _ in range(2):
            async with http.post(sidecar + "/v1/chat/completions", json=chat(words(40), 2)) as resp:
                usage = (await resp.json())["usage"]
        async with http.get(sidecar + "/metrics") as resp:
            text = await resp.text()
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert "cachewitness_upstream_metrics_up 1.0" in text
    assert 'trtllm_prompt_cache_hit_tokens_total{cache_level="0",cache_tier="gpu"' in text
