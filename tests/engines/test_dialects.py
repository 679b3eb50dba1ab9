"""Each engine dialect's reset rules (docs/engines.md), one attempt at a time, against the simulator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from proxy.engines.base import Attempt, AttemptPlan, Dialect
from proxy.engines.generic import GenericDialect
from proxy.engines.llamacpp import LlamacppDialect
from proxy.engines.mindnano import MindnanoDialect
from proxy.engines.none import NoResetDialect
from proxy.engines.sglang import SglangDialect
from proxy.engines.vllm import VllmDialect
from proxy.redact import redact_url
from proxy.reset.retry import retry_reset
from proxy.vocabulary import ResetAnswer
from tests.support.sidecar import closed_port_url, serve_app
from tests.support.sim import Sim, chat, fast, sim, slow, words
from tests.support.upstream import in_two_pieces

TIMEOUT_S = 10.0


async def reset(
    dialect: Dialect,
    http: aiohttp.ClientSession,
    url: str,
    *,
    force: bool = False,
    retry_seconds: float = 0.0,
    timeout_s: float = TIMEOUT_S,
) -> Attempt:
    plan = AttemptPlan(url, force=force, retry_seconds=retry_seconds, timeout_s=timeout_s)
    return await dialect.reset_once(http, plan)


@asynccontextmanager
async def running_request(
    engine: Sim, path: str = "/v1/chat/completions", **body: object
) -> AsyncIterator[None]:
    """A long generation in flight on the simulator for the duration of the block (cancelled at exit)."""
    task = asyncio.create_task(engine.post_json(path, body or chat(words(8), max_tokens=2000)))
    try:
        await engine.wait_stats(lambda s: s["running"] >= 1)
        yield
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


# -- vLLM ----------------------------------------------------------------------------------


async def test_vllm_idle_reset_is_acknowledged(http: aiohttp.ClientSession) -> None:
    async with sim(fast("vllm")) as engine:
        attempt = await reset(VllmDialect(), http, engine.url)
        assert (attempt.outcome, attempt.status, attempt.success) == (ResetAnswer.ACKNOWLEDGED, 200, True)
        assert attempt.url.endswith("/reset_prefix_cache?reset_external=true")
        assert (await engine.stats())["resets_total"] == 1


async def test_vllm_success_false_while_a_request_runs_is_refused(http: aiohttp.ClientSession) -> None:
    async with sim(slow("vllm")) as engine, running_request(engine):
        attempt = await reset(VllmDialect(), http, engine.url)
        assert (attempt.outcome, attempt.status, attempt.success) == (ResetAnswer.REFUSED, 200, False)
        assert '"success":false' in attempt.calls[0].body_excerpt.replace(" ", "")


async def test_vllm_force_sends_reset_running_requests(http: aiohttp.ClientSession) -> None:
    async with sim(slow("vllm")) as engine, running_request(engine):
        attempt = await reset(VllmDialect(), http, engine.url, force=True)
        assert attempt.outcome == ResetAnswer.ACKNOWLEDGED
        assert "reset_running_requests=true" in attempt.url and "reset_external=true" in attempt.url


async def test_vllm_legacy_empty_body_is_accepted_unverified(http: aiohttp.ClientSession) -> None:
    async with sim(fast("vllm", legacy_empty_body=True)) as engine:
        attempt = await reset(VllmDialect(), http, engine.url)
        assert (attempt.outcome, attempt.status, attempt.success) == (
            ResetAnswer.ACCEPTED_UNVERIFIED,
            200,
            None,
        )
        assert attempt.warning and "0.26" in attempt.warning


async def test_vllm_without_dev_mode_is_unsupported_with_hint(http: aiohttp.ClientSession) -> None:
    async with sim(fast("vllm", dev_mode=False)) as engine:
        attempt = await reset(VllmDialect(), http, engine.url)
        assert (attempt.outcome, attempt.status) == (ResetAnswer.UNSUPPORTED, 404)
        assert attempt.hint and "VLLM_SERVER_DEV_MODE=1" in attempt.hint


# -- SGLang --------------------------------------------------------------------------------


async def test_sglang_idle_flush_is_acknowledged_with_timeout_param(http: aiohttp.ClientSession) -> None:
    async with sim(fast("sglang")) as engine:
        attempt = await reset(SglangDialect(), http, engine.url, retry_seconds=7)
        assert (attempt.outcome, attempt.status) == (ResetAnswer.ACKNOWLEDGED, 200)
        assert attempt.url.endswith("/flush_cache?timeout=7")


async def test_sglang_400_while_busy_is_refused_and_its_body_kept(http: aiohttp.ClientSession) -> None:
    async with sim(slow("sglang")) as engine, running_request(engine):
        attempt = await reset(SglangDialect(), http, engine.url, retry_seconds=0)
        assert (attempt.outcome, attempt.status) == (ResetAnswer.REFUSED, 400)
        assert "Flush cache failed" in attempt.calls[0].body_excerpt


async def test_sglang_timeout_waits_for_the_running_request_to_end(http: aiohttp.ClientSession) -> None:
    async with sim(slow("sglang")) as engine:
        request = asyncio.create_task(engine.post_json("/v1/chat/completions", chat(words(8), max_tokens=20)))
        await engine.wait_stats(lambda s: s["running"] == 1)
        attempt = await reset(SglangDialect(), http, engine.url, retry_seconds=30)
        status, _ = await request
        assert status == 200
        assert attempt.outcome == ResetAnswer.ACKNOWLEDGED


async def test_sglang_admin_key_is_sent_as_bearer(http: aiohttp.ClientSession) -> None:
    async with sim(fast("sglang", admin_api_key="s3cret")) as engine:
        attempt = await reset(SglangDialect(api_key="s3cret"), http, engine.url)
        assert attempt.outcome == ResetAnswer.ACKNOWLEDGED


async def test_sglang_missing_admin_key_is_an_error_with_hint(http: aiohttp.ClientSession) -> None:
    async with sim(fast("sglang", admin_api_key="s3cret")) as engine:
        attempt = await reset(SglangDialect(), http, engine.url)
        assert (attempt.outcome, attempt.status) == (ResetAnswer.ERROR, 401)
        assert attempt.hint and "upstream_api_key" in attempt.hint


# -- llama.cpp -----------------------------------------------------------------------------


async def test_llamacpp_erases_every_slot(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    async with sim(fast("llamacpp", slots=3, slot_save_path=str(tmp_path))) as engine:
        for slot in range(3):
            await engine.post_json(
                "/completion", {"prompt": words(20, f"s{slot}"), "n_predict": 2, "id_slot": slot}
            )
        assert all((await engine.stats())["slot_tokens"])
        attempt = await reset(LlamacppDialect(), http, engine.url)
        assert attempt.outcome == ResetAnswer.ACKNOWLEDGED
        assert [call.url.rsplit("/", 1)[1] for call in attempt.calls] == [
            "props",
            "slots",
            "0?action=erase",
            "1?action=erase",
            "2?action=erase",
        ]
        assert attempt.url.endswith("/slots/2?action=erase")
        assert (await engine.stats())["slot_tokens"] == [0, 0, 0]


async def test_llamacpp_answer_always_warns_about_cache_ram(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    async with sim(fast("llamacpp", slot_save_path=str(tmp_path))) as engine:
        attempt = await reset(LlamacppDialect(), http, engine.url)
        assert attempt.outcome == ResetAnswer.ACKNOWLEDGED
        assert attempt.warning and "--cache-ram 0" in attempt.warning


async def test_llamacpp_generating_slot_is_refused_without_an_erase(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """A busy slot's erase would block until its generation ends: /slots says so first."""
    async with (
        sim(slow("llamacpp", slot_save_path=str(tmp_path))) as engine,
        running_request(engine, "/completion", prompt=words(8), n_predict=2000, id_slot=0),
    ):
        attempt = await reset(LlamacppDialect(), http, engine.url, retry_seconds=2.0)
    assert attempt.outcome == ResetAnswer.REFUSED
    assert attempt.error and attempt.error.startswith("slot 0 generating")
    assert [call.url.rsplit("/", 1)[1] for call in attempt.calls] == ["props", "slots"]


def erase_that_blocks() -> web.Application:
    """A llama-server whose /slots says idle but whose erase blocks (a slot turned busy in between)."""

    async def props(request: web.Request) -> web.Response:
        return web.json_response({"total_slots": 1})

    async def slots(request: web.Request) -> web.Response:
        return web.json_response([{"id": 0, "is_processing": False}])

    async def erase(request: web.Request) -> web.Response:
        await asyncio.Event().wait()  # until the sidecar gives up and hangs up
        return web.json_response({"id_slot": 0, "n_erased": 0})

    app = web.Application()
    app.router.add_get("/props", props)
    app.router.add_get("/slots", slots)
    app.router.add_post("/slots/{id}", erase)
    return app


async def test_llamacpp_erase_is_bounded_by_the_retry_window_and_refused(http: aiohttp.ClientSession) -> None:
    async with serve_app(erase_that_blocks()) as url:
        attempt = await reset(LlamacppDialect(), http, url, retry_seconds=1.0, timeout_s=TIMEOUT_S)
    assert attempt.outcome == ResetAnswer.REFUSED
    assert attempt.error and "still waited on a busy slot" in attempt.error
    assert attempt.calls[-1].elapsed_s < TIMEOUT_S / 2  # the window, not the attempt timeout


async def test_llamacpp_erase_that_times_out_is_retried_while_the_window_lasts(
    http: aiohttp.ClientSession,
) -> None:
    """An attempt timeout shorter than the window: each timed-out erase is a refusal, retried."""
    async with serve_app(erase_that_blocks()) as url:
        reset_ = await retry_reset(
            LlamacppDialect(), http, url, force=False, retry_seconds=2.0, timeout_s=0.6
        )
    assert reset_.outcome == ResetAnswer.REFUSED and reset_.attempts >= 2
    erases = [call for call in reset_.calls if "action=erase" in call.url]
    assert len(erases) == reset_.attempts and all(call.error for call in erases)


async def test_llamacpp_answers_that_arrive_in_two_pieces_are_read_whole(http: aiohttp.ClientSession) -> None:
    app = web.Application()
    app.router.add_get("/props", in_two_pieces({"total_slots": 2, "build_info": "b1-" + "x" * 200}))
    app.router.add_get("/slots", in_two_pieces([{"id": i, "is_processing": False} for i in range(2)]))
    app.router.add_post("/slots/{id}", in_two_pieces({"id_slot": 0, "n_erased": 12}))
    async with serve_app(app) as url:
        attempt = await reset(LlamacppDialect(), http, url)
    assert attempt.outcome == ResetAnswer.ACKNOWLEDGED, attempt.error
    assert len(attempt.calls) == 4


async def test_llamacpp_without_slot_save_path_is_unsupported_with_hint(http: aiohttp.ClientSession) -> None:
    async with sim(fast("llamacpp")) as engine:
        attempt = await reset(LlamacppDialect(), http, engine.url)
        assert (attempt.outcome, attempt.status) == (ResetAnswer.UNSUPPORTED, 501)
        assert attempt.hint and "--slot-save-path" in attempt.hint
        assert attempt.warning and "--cache-ram 0" in attempt.warning


# -- mindnano ------------------------------------------------------------------------------


async def test_mindnano_idle_clear_is_acknowledged(http: aiohttp.ClientSession) -> None:
    async with sim(fast("mindnano")) as engine:
        attempt = await reset(MindnanoDialect(), http, engine.url)
        assert (attempt.outcome, attempt.status) == (ResetAnswer.ACKNOWLEDGED, 200)
        assert (await engine.stats())["resets_total"] == 1


async def test_mindnano_429_while_busy_is_refused(http: aiohttp.ClientSession) -> None:
    async with sim(slow("mindnano")) as engine, running_request(engine):
        attempt = await reset(MindnanoDialect(), http, engine.url)
        assert (attempt.outcome, attempt.status) == (ResetAnswer.REFUSED, 429)


# -- generic and none ----------------------------------------------------------------------


async def test_generic_without_reset_path_is_unsupported_with_hint(http: aiohttp.ClientSession) -> None:
    async with sim(fast("openai")) as engine:
        attempt = await reset(GenericDialect(), http, engine.url)
        assert attempt.outcome == ResetAnswer.UNSUPPORTED
        assert attempt.hint and "reset_path" in attempt.hint
        assert attempt.calls == ()


async def test_generic_configured_route_reads_the_success_field(http: aiohttp.ClientSession) -> None:
    async with sim(fast("vllm")) as engine:
        dialect = GenericDialect(reset_path="/reset_prefix_cache", success_field="success")
        attempt = await reset(dialect, http, engine.url)
        assert (attempt.outcome, attempt.success) == (ResetAnswer.ACKNOWLEDGED, True)


async def test_generic_busy_status_is_refused(http: aiohttp.ClientSession) -> None:
    async with sim(slow("mindnano")) as engine, running_request(engine):
        dialect = GenericDialect(reset_path="/v1/cache/clear", busy_statuses=(429,))
        attempt = await reset(dialect, http, engine.url)
        assert (attempt.outcome, attempt.status) == (ResetAnswer.REFUSED, 429)


async def test_generic_2xx_without_success_field_is_accepted_unverified(http: aiohttp.ClientSession) -> None:
    async with sim(fast("mindnano")) as engine:
        attempt = await reset(GenericDialect(reset_path="/v1/cache/clear"), http, engine.url)
        assert (attempt.outcome, attempt.status) == (ResetAnswer.ACCEPTED_UNVERIFIED, 200)


async def test_none_dialect_is_unsupported_without_calling(http: aiohttp.ClientSession) -> None:
    attempt = await reset(NoResetDialect(), http, closed_port_url())
    assert attempt.outcome == ResetAnswer.UNSUPPORTED and attempt.calls == ()
    assert attempt.hint and "--engine" in attempt.hint


# -- transport -----------------------------------------------------------------------------


async def test_no_connection_is_unreachable(http: aiohttp.ClientSession) -> None:
    attempt = await reset(VllmDialect(), http, closed_port_url())
    assert attempt.outcome == ResetAnswer.UNREACHABLE and attempt.status is None
    assert attempt.calls[0].error


async def test_5xx_is_an_error(http: aiohttp.ClientSession) -> None:
    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    app = web.Application()
    app.router.add_post("/v1/cache/clear", broken)
    async with serve_app(app) as url:
        attempt = await reset(MindnanoDialect(), http, url)
    assert (attempt.outcome, attempt.status) == (ResetAnswer.ERROR, 500)
    assert attempt.calls[0].body_excerpt == "boom"


async def test_other_4xx_is_an_error_that_names_the_status(http: aiohttp.ClientSession) -> None:
    async def teapot(request: web.Request) -> web.Response:
        return web.Response(status=418)

    app = web.Application()
    app.router.add_post("/reset_prefix_cache", teapot)
    async with serve_app(app) as url:
        attempt = await reset(VllmDialect(), http, url)
    assert attempt.outcome == ResetAnswer.ERROR and attempt.error and "418" in attempt.error


async def test_engine_call_urls_are_redacted(http: aiohttp.ClientSession) -> None:
    async with sim(fast("vllm")) as engine:
        with_credentials = engine.url.replace("http://", "http://user:pw@")
        attempt = await reset(VllmDialect(), http, with_credentials)
    assert "pw" not in attempt.url and "***@" in attempt.url
    assert all("pw" not in call.url for call in attempt.calls)


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("http://user:pw@engine:8000/x", "http://***@engine:8000/x"),
        ("http://engine/x?api_key=k&token=t&a=1", "http://engine/x?api_key=***&token=***&a=1"),
        ("http://engine/x?Secret=s&PASSWORD=p", "http://engine/x?Secret=***&PASSWORD=***"),
        (
            "http://engine/reset_prefix_cache?reset_external=true",
            "http://engine/reset_prefix_cache?reset_external=true",
        ),
        ("http://[::1/x?key=1", "http://[::1/x?***"),
    ],
)
def test_redact_url(url: str, redacted: str) -> None:
    assert redact_url(url) == redacted
