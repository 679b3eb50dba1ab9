"""`--engine auto` detection (the order of docs/engines.md) and the engine state built on it."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from proxy.config import Settings
from proxy.engine_state import EngineState
from proxy.engines.base import AttemptPlan
from proxy.engines.detect import detect_engine, probe_version
from proxy.sim import build_sim_app
from proxy.vocabulary import EngineKind, ResetAnswer
from tests.support.sidecar import closed_port_url, serve_app
from tests.support.sim import fast, sim
from tests.support.upstream import in_two_pieces

TIMEOUT_S = 5.0


@pytest.mark.parametrize(
    ("dialect", "kind", "version"),
    [
        ("vllm", "vllm", "0.32.0"),
        ("sglang", "sglang", "0.5.10"),
        ("llamacpp", "llamacpp", "b6000-sim"),
        ("mindnano", "mindnano", None),
        # /version like vLLM's, /server_info without a version: told apart by owned_by.
        ("trtllm", "trtllm", "1.3.0rc29"),
        ("dynamo", "dynamo", None),
    ],
)
async def test_each_engine_is_detected_with_its_version(
    http: aiohttp.ClientSession, dialect: str, kind: str, version: str | None
) -> None:
    async with sim(fast(dialect)) as engine:
        info = await detect_engine(http, engine.url, TIMEOUT_S)
    assert info.kind == kind
    if version is not None:
        assert info.version == version


async def test_a_dynamo_frontend_is_known_by_the_instances_its_health_lists(
    http: aiohttp.ClientSession,
) -> None:
    async def health(_request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "healthy", "endpoints": ["dyn://dynamo.backend.generate"], "instances": []}
        )

    app = web.Application()
    app.router.add_get("/health", health)  # nothing else: no /live, no /v1/models
    async with serve_app(app) as url:
        info = await detect_engine(http, url, TIMEOUT_S)
    assert info.kind == "dynamo"


async def test_a_dynamo_frontend_still_discovering_is_known_by_live_and_its_owner(
    http: aiohttp.ClientSession,
) -> None:
    async def health(_request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "not_ready", "message": "Initial model discovery in progress"}, status=503
        )

    async def live(_request: web.Request) -> web.Response:
        return web.json_response({"status": "live", "message": "Service is live"})

    async def models(_request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "nvidia"}]}
        )

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/live", live)
    app.router.add_get("/v1/models", models)
    async with serve_app(app) as url:
        info = await detect_engine(http, url, TIMEOUT_S)
    assert info.to_json() == {"kind": "dynamo", "version": None}


async def test_detection_reads_an_answer_that_arrives_in_two_pieces(http: aiohttp.ClientSession) -> None:
    app = web.Application()
    app.router.add_get("/server_info", in_two_pieces({"version": "0.5.10", "padding": "x" * 500}))
    async with serve_app(app) as url:
        info = await detect_engine(http, url, TIMEOUT_S)
    assert (info.kind, info.version) == ("sglang", "0.5.10")


async def test_plain_openai_engine_is_generic(http: aiohttp.ClientSession) -> None:
    async with sim(fast("openai")) as engine:
        info = await detect_engine(http, engine.url, TIMEOUT_S)
    assert info.to_json() == {"kind": "generic", "version": None}


async def test_unreachable_upstream_is_unknown(http: aiohttp.ClientSession) -> None:
    info = await detect_engine(http, closed_port_url(), TIMEOUT_S)
    assert info.kind == "unknown"


async def test_explicit_kind_gets_its_version_probed(http: aiohttp.ClientSession) -> None:
    async with sim(fast("sglang", version="0.5.11")) as engine:
        assert await probe_version(http, engine.url, EngineKind.SGLANG, TIMEOUT_S) == "0.5.11"


async def test_engine_state_detects_and_picks_the_dialect(http: aiohttp.ClientSession) -> None:
    async with sim(fast("llamacpp")) as engine:
        state = EngineState(Settings(upstream=engine.url))
        await state.detect(http)
    assert state.info.kind == "llamacpp"
    assert state.dialect.kind == "llamacpp"
    assert state.health_path == "/health"


async def test_engine_state_configured_kind_is_kept_without_detection(http: aiohttp.ClientSession) -> None:
    async with sim(fast("vllm", version="0.9.2")) as engine:
        state = EngineState(Settings(upstream=engine.url, engine="vllm"))
        await state.detect(http)
    assert state.info.to_json() == {"kind": "vllm", "version": "0.9.2"}


async def test_engine_state_redetects_when_the_upstream_comes_back(http: aiohttp.ClientSession) -> None:
    async with sim(fast("vllm")) as first:
        state = EngineState(Settings(upstream=first.url))
        await state.detect(http)
    assert state.info.kind == "vllm"
    # Another engine now answers at the same address after the upstream was down.
    host, port = first.url.removeprefix("http://").split(":")
    runner = web.AppRunner(build_sim_app(fast("mindnano")), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, int(port)).start()
        await state.upstream_came_back(http)
    finally:
        await runner.cleanup()
    assert state.info.kind == "mindnano"
    assert state.dialect.kind == "mindnano"


async def test_undetected_engine_answers_resets_unreachable(http: aiohttp.ClientSession) -> None:
    state = EngineState(Settings(upstream=closed_port_url()))
    await state.detect(http)
    attempt = await state.dialect.reset_once(http, AttemptPlan(closed_port_url(), timeout_s=1))
    assert attempt.outcome == ResetAnswer.UNREACHABLE
    assert attempt.hint and "--engine" in attempt.hint


async def test_health_path_comes_from_settings_for_generic(http: aiohttp.ClientSession) -> None:
    async with sim(fast("openai")) as engine:
        state = EngineState(Settings(upstream=engine.url, health_path="/v1/models"))
        await state.detect(http)
    assert state.health_path == "/v1/models"
