"""The simulator's dynamo dialect: the frontend's /clear_kv_blocks over its workers, 200 whatever they said."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from tests.support.sim import Sim, chat, fast, sim, slow, words


async def clear(s: Sim) -> dict[str, Any]:
    """POST /clear_kv_blocks, which must answer 200."""
    status, body = await s.post_json("/clear_kv_blocks", {})
    assert status == 200
    answer: dict[str, Any] = body
    return answer


def statuses(body: dict[str, Any]) -> list[str]:
    """Each cleared worker's own answer `status`, read from its JSON string."""
    return [orjson.loads(entry["response"])["status"] for entry in body["cleared_workers"]]


async def test_a_repeat_goes_to_the_worker_that_holds_its_prefix() -> None:
    async with sim(fast("dynamo", dp_size=2)) as s:
        body = chat(words(40))
        assert await s.cached(body) == 0
        assert await s.cached(body) > 0  # KV routing, not round-robin onto the cold worker


async def test_every_idle_worker_clears() -> None:
    async with sim(fast("dynamo", dp_size=2)) as s:
        body = chat(words(40))
        await s.cached(body)
        answer = await clear(s)
        assert statuses(answer) == ["success", "success"] and answer["failed_workers"] == []
        assert await s.cached(body) == 0


async def test_a_busy_worker_answers_error_inside_a_200() -> None:
    async with sim(slow("dynamo")) as s:
        task = asyncio.create_task(s.post_json("/v1/chat/completions", chat("hi", max_tokens=50)))
        await s.wait_stats(lambda st: st["running"] == 1)
        answer = await clear(s)
        await task
    assert statuses(answer) == ["error"]
    assert orjson.loads(answer["cleared_workers"][0]["response"])["message"] == "KV cache reset failed"


async def test_an_unreachable_worker_is_listed_failed_and_keeps_its_cache() -> None:
    async with sim(fast("dynamo", unreachable_worker=0)) as s:
        body = chat(words(40))
        await s.cached(body)
        answer = await clear(s)
        assert answer["cleared_workers"] == [] and len(answer["failed_workers"]) == 1
        assert await s.cached(body) > 0


async def test_no_version_route_and_a_health_that_lists_instances() -> None:
    async with sim(fast("dynamo", dp_size=2)) as s:
        async with s.http.get(s.url + "/version") as resp:
            assert resp.status == 404
        async with s.http.get(s.url + "/health") as resp:
            health = await resp.json()
    assert health["status"] == "healthy" and len(health["instances"]) == 2
