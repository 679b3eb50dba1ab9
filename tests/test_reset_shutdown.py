"""A reset in progress at shutdown finishes within the grace period, or is recorded as cut short (issue 13, item 5)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from proxy.serve import serve
from tests.support.client import CLIENT_TIMEOUT
from tests.support.evidence_files import evidence_records
from tests.support.sidecar import free_port, make_settings, serve_app
from tests.support.sim import WAIT_S


def engine_that_resets_when_told(answer_after: asyncio.Event, called: asyncio.Event) -> web.Application:
    """A vLLM whose reset answers only once `answer_after` is set; `called` says the call arrived."""

    async def reset(request: web.Request) -> web.Response:
        called.set()
        await answer_after.wait()
        return web.json_response({"success": True})

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: first\n\n")
        await asyncio.Event().wait()  # until the sidecar cuts it
        return response

    app = web.Application()
    app.router.add_post("/reset_prefix_cache", reset)
    app.router.add_get("/endless", endless)
    return app


def cache_states(tmp_path: Path) -> list[dict[str, Any]]:
    """The infer.cache_state records the sidecar wrote."""
    records = evidence_records(tmp_path / "evidence" / "cachewitness.jsonl")
    return [r for r in records if r["event_type"] == "infer.cache_state"]


async def shut_down_during_a_reset(
    tmp_path: Path, engine_answers_after: float | None, grace_period: float, *, stream_in_flight: bool = False
) -> None:
    """`serve` a sidecar; start a reset whose caller hangs up; shut down while the engine still works on it.

    The engine answers `engine_answers_after` seconds into the shutdown (None: never).
    `stream_in_flight`: an endless stream keeps the shutdown waiting for the whole grace period.
    """
    called, engine_answers = asyncio.Event(), asyncio.Event()
    async with serve_app(engine_that_resets_when_told(engine_answers, called)) as upstream:
        listen = f"127.0.0.1:{free_port()}"
        settings = make_settings(
            upstream, tmp_path, listen=listen, engine="vllm", health_interval=3600, grace_period=grace_period
        )
        stop = asyncio.Event()
        sidecar = asyncio.create_task(serve(settings, stop))
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
            caller = asyncio.create_task(
                post_when_up(http, f"http://{listen}/cache/reset", {"case_id": "at-shutdown", "drain": False})
            )
            await called.wait()
            caller.cancel()  # the caller hangs up: its request does not keep shutdown waiting
            with contextlib.suppress(asyncio.CancelledError):
                await caller
            stream = await http.get(f"http://{listen}/endless") if stream_in_flight else None
            stop.set()
            if engine_answers_after is not None:
                asyncio.get_running_loop().call_later(engine_answers_after, engine_answers.set)
            await sidecar
            if stream is not None:
                stream.close()


async def post_when_up(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    """POST once the sidecar listens (bounded by WAIT_S)."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        try:
            async with http.post(url, json=body) as response:
                await response.read()
                return
        except aiohttp.ClientConnectorError:
            assert asyncio.get_running_loop().time() < deadline, "the sidecar never listened"
            await asyncio.sleep(0.01)


async def test_reset_in_progress_at_shutdown_finishes_within_the_grace_period(tmp_path: Path) -> None:
    await shut_down_during_a_reset(tmp_path, engine_answers_after=0.2, grace_period=10)
    (record,) = cache_states(tmp_path)
    assert record["case_id"] == "at-shutdown"
    assert record["reset"]["answer"] == "acknowledged", record["reset"]


async def test_reset_still_running_when_the_grace_period_ends_is_recorded_as_interrupted(
    tmp_path: Path,
) -> None:
    await shut_down_during_a_reset(tmp_path, engine_answers_after=None, grace_period=0.3)
    (record,) = cache_states(tmp_path)
    assert record["case_id"] == "at-shutdown"
    assert record["reset"]["answer"] is None
    assert record["reset"]["error"] == "error: interrupted by shutdown"
    assert record["acknowledged"] is False


async def test_the_grace_period_is_shared_with_the_requests_in_flight_not_added_to_it(tmp_path: Path) -> None:
    """A stream holds shutdown for the whole grace period; the reset then gets no second one."""
    await shut_down_during_a_reset(
        tmp_path, engine_answers_after=2.0, grace_period=1.0, stream_in_flight=True
    )
    (record,) = cache_states(tmp_path)
    assert record["reset"]["error"] == "error: interrupted by shutdown"
