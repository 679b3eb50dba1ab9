"""The simulator's trtllm dialect: trtllm-serve's JSON /metrics, /prometheus/metrics, and its reset route."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from tests.support.sim import chat, fast, sim, slow, words


async def test_metrics_is_json_and_the_prometheus_text_is_elsewhere() -> None:
    async with sim(fast("trtllm")) as s:
        await s.cached(chat(words(40)))
        async with s.http.get(s.url + "/metrics") as resp:
            assert resp.content_type == "application/json"
            assert isinstance(await resp.json(), list)
        async with s.http.get(s.url + "/prometheus/metrics") as resp:
            names = {f.name for f in text_string_to_metric_families(await resp.text())}
    assert {"trtllm_prompt_tokens", "trtllm_prompt_cached_tokens", "trtllm_prompt_cache_hit_tokens"} <= names


async def test_without_perf_metrics_there_is_no_prometheus_text() -> None:
    async with (
        sim(fast("trtllm", perf_metrics=False)) as s,
        s.http.get(s.url + "/prometheus/metrics") as resp,
    ):
        assert resp.status == 404


async def test_server_info_has_no_version_and_version_looks_like_vllms() -> None:
    async with sim(fast("trtllm")) as s:
        async with s.http.get(s.url + "/server_info") as resp:
            assert "version" not in await resp.json()
        async with s.http.get(s.url + "/version") as resp:
            assert await resp.json() == {"version": "1.3.0rc29"}


async def test_reset_clears_when_idle_and_refuses_while_a_request_runs() -> None:
    async with sim(slow("trtllm")) as s:
        body = chat(words(40), max_tokens=1)
        await s.cached(body)
        assert await s.cached(body) > 0
        assert await s.post_json("/reset_prefix_cache", {}) == (200, {"success": True})
        assert await s.cached(body) == 0
        task = asyncio.create_task(s.post_json("/v1/chat/completions", chat("hi", max_tokens=50)))
        await s.wait_stats(lambda st: st["running"] == 1)
        assert await s.post_json("/reset_prefix_cache", {}) == (200, {"success": False})
        await task


async def test_a_release_without_the_route_answers_404() -> None:
    async with sim(fast("trtllm", reset_route=False)) as s:
        status, _ = await s.post_json("/reset_prefix_cache", {})
        assert status == 404
