"""The simulator's mindnano dialect: one request at a time, clear, cancel, per-user cache."""

from __future__ import annotations

import asyncio

from tests.sim_helpers import (
    chat,
    event_json,
    fast,
    next_event,
    read_events,
    sim,
    slow,
    words,
)


async def test_second_request_while_busy_is_429() -> None:
    async with sim(slow("mindnano")) as s:
        task = asyncio.create_task(s.post_json("/v1/chat/completions", chat("one", max_tokens=20)))
        await s.wait_stats(lambda st: st["running"] == 1)
        status, _ = await s.post_json("/v1/chat/completions", chat("two"))
        assert status == 429
        assert (await task)[0] == 200


async def test_clear_while_busy_is_429_and_200_when_idle() -> None:
    async with sim(slow("mindnano")) as s:
        task = asyncio.create_task(s.post_json("/v1/chat/completions", chat("one", max_tokens=20)))
        await s.wait_stats(lambda st: st["running"] == 1)
        assert (await s.post_json("/v1/cache/clear", {}))[0] == 429
        await task
        assert await s.post_json("/v1/cache/clear", {}) == (200, {"cleared": True})


async def test_clear_empties_the_cache() -> None:
    async with sim(fast("mindnano")) as s:
        body = chat(words(40), user="u1")
        await s.cached(body)
        await s.post_json("/v1/cache/clear", {})
        assert await s.cached(body) == 0


async def test_health_reports_active() -> None:
    async with sim(slow("mindnano")) as s:
        async with s.http.get(s.url + "/health") as resp:
            assert await resp.json() == {"status": "ok", "active": False}
        task = asyncio.create_task(s.post_json("/v1/chat/completions", chat("one", max_tokens=20)))
        await s.wait_stats(lambda st: st["running"] == 1)
        async with s.http.get(s.url + "/health") as resp:
            assert (await resp.json())["active"] is True
        await task


async def test_cancel_makes_the_active_request_answer_409() -> None:
    async with sim(slow("mindnano")) as s:
        task = asyncio.create_task(s.post_json("/v1/chat/completions", chat("one", max_tokens=100_000)))
        await s.wait_stats(lambda st: st["running"] == 1)
        assert await s.post_json("/v1/cancel", {}) == (200, {"cancel_requested": True})
        status, _ = await task
        assert status == 409
        stats = await s.stats()
        assert (stats["running"], stats["aborted_total"]) == (0, 1)


async def test_cancel_ends_an_active_stream() -> None:
    async with sim(slow("mindnano")) as s:
        body = chat("one", max_tokens=100_000, stream=True)
        async with s.http.post(s.url + "/v1/chat/completions", json=body) as resp:
            await next_event(resp)
            await s.post_json("/v1/cancel", {})
            events = await read_events(resp)
        assert events[-1] == b"data: [DONE]"
        assert event_json(events[-2])["choices"][0]["finish_reason"] == "cancelled"


async def test_cancel_when_idle_requests_nothing() -> None:
    async with sim(fast("mindnano")) as s:
        assert await s.post_json("/v1/cancel", {}) == (200, {"cancel_requested": False})


async def test_cache_is_isolated_per_user() -> None:
    async with sim(fast("mindnano")) as s:
        await s.cached(chat(words(40), user="alice"))
        assert await s.cached(chat(words(40), user="bob")) == 0
        assert await s.cached(chat(words(40), user="alice")) == 32


async def test_response_carries_mindnano_metrics() -> None:
    async with sim(fast("mindnano")) as s:
        body = chat(words(40))
        await s.cached(body)
        _, data = await s.post_json("/v1/chat/completions", body)
        assert data["mindnano_metrics"] == {"cached_tokens": 32, "prompt_evaluated_tokens": 13}


async def test_stream_finish_event_carries_mindnano_metrics() -> None:
    async with sim(fast("mindnano")) as s:
        async with s.http.post(
            s.url + "/v1/chat/completions", json=chat("hi", max_tokens=2, stream=True)
        ) as resp:
            events = await read_events(resp)
        finish = event_json(events[-2])
        assert finish["choices"][0]["finish_reason"] == "length"
        assert finish["mindnano_metrics"] == {"cached_tokens": 0, "prompt_evaluated_tokens": 6}


async def test_cache_prompt_false_skips_the_cache() -> None:
    async with sim(fast("mindnano")) as s:
        await s.cached(chat(words(40)))
        assert await s.cached(chat(words(40), cache_prompt=False)) == 0
