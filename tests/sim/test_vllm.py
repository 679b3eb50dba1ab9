"""The simulator's vLLM dialect: reset rules, cached-token options, routes."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from tests.support.sim import chat, fast, next_event, sim, slow, words


async def test_reset_is_refused_while_a_stream_runs_and_accepted_after() -> None:
    async with sim(slow("vllm")) as s:
        resp = await s.http.post(s.url + "/v1/chat/completions", json=chat("hi", max_tokens=20, stream=True))
        await next_event(resp)
        assert await s.post_json("/reset_prefix_cache?reset_external=true", {}) == (200, {"success": False})
        await resp.read()
        resp.release()
        await s.wait_stats(lambda st: st["running"] == 0)
        assert await s.post_json("/reset_prefix_cache?reset_external=true", {}) == (200, {"success": True})


async def test_reset_empties_the_prefix_cache() -> None:
    async with sim(fast("vllm")) as s:
        body = chat(words(40))
        await s.cached(body)
        assert await s.cached(body) == 32
        assert await s.post_json("/reset_prefix_cache", {}) == (200, {"success": True})
        assert await s.cached(body) == 0
        assert (await s.stats())["resets_total"] == 1


async def test_reset_running_requests_preempts_and_succeeds() -> None:
    async with sim(slow("vllm")) as s:
        resp = await s.http.post(s.url + "/v1/chat/completions", json=chat("hi", max_tokens=20, stream=True))
        await next_event(resp)
        status, data = await s.post_json(
            "/reset_prefix_cache?reset_running_requests=true&reset_external=true", {}
        )
        assert (status, data) == (200, {"success": True})
        # Preempted, not failed: the stream still runs to its end.
        body = await resp.read()
        resp.release()
        assert body.endswith(b"data: [DONE]\n\n")
        assert (await s.stats())["completed_total"] == 1


async def test_stream_options_without_stream_is_400() -> None:
    async with sim(fast("vllm")) as s:
        status, data = await s.post_json(
            "/v1/chat/completions", chat("hi", stream_options={"include_usage": True})
        )
        assert status == 400
        assert "stream" in data["error"]["message"]


async def test_other_dialects_ignore_stream_options_without_stream() -> None:
    async with sim(fast("sglang")) as s:
        status, _ = await s.post_json(
            "/v1/chat/completions", chat("hi", stream_options={"include_usage": True})
        )
        assert status == 200


async def test_legacy_empty_body_answers_200_empty_even_when_refused() -> None:
    async with sim(slow("vllm", legacy_empty_body=True)) as s:
        resp = await s.http.post(s.url + "/v1/chat/completions", json=chat("hi", max_tokens=20, stream=True))
        await next_event(resp)
        async with s.http.post(s.url + "/reset_prefix_cache") as reset:
            assert (reset.status, await reset.read()) == (200, b"")
        assert (await s.stats())["resets_total"] == 0
        await resp.read()
        resp.release()


async def test_legacy_empty_body_resets_when_idle() -> None:
    async with sim(fast("vllm", legacy_empty_body=True)) as s:
        async with s.http.post(s.url + "/reset_prefix_cache") as reset:
            assert (reset.status, await reset.read()) == (200, b"")
        assert (await s.stats())["resets_total"] == 1


async def test_no_dev_mode_has_no_reset_route() -> None:
    async with sim(fast("vllm", dev_mode=False)) as s:
        assert await s.post_json("/reset_prefix_cache", {}) == (404, {"detail": "Not Found"})


async def test_omit_zero_cached_drops_the_field_when_zero() -> None:
    async with sim(fast("vllm", omit_zero_cached=True)) as s:
        body = chat(words(40))
        _, first = await s.post_json("/v1/chat/completions", body)
        assert "prompt_tokens_details" not in first["usage"]
        assert await s.cached(body) == 32


async def test_no_prompt_tokens_details_never_reports_cached() -> None:
    async with sim(fast("vllm", prompt_tokens_details=False)) as s:
        body = chat(words(40))
        await s.post_json("/v1/chat/completions", body)
        _, second = await s.post_json("/v1/chat/completions", body)
        assert "prompt_tokens_details" not in second["usage"]


async def test_version_route_reports_the_configured_version() -> None:
    async with sim(fast("vllm", version="0.25.1")) as s, s.http.get(s.url + "/version") as resp:
        assert await resp.json() == {"version": "0.25.1"}


async def test_health_is_200() -> None:
    async with sim(fast("vllm")) as s, s.http.get(s.url + "/health") as resp:
        assert resp.status == 200


async def test_metrics_count_prefix_cache_queries_and_hits() -> None:
    async with sim(fast("vllm")) as s:
        body = chat(words(40))
        await s.cached(body)
        await s.cached(body)
        async with s.http.get(s.url + "/metrics") as resp:
            text = await resp.text()
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        assert samples["vllm:prefix_cache_queries_total"] == 90
        assert samples["vllm:prefix_cache_hits_total"] == 32
        assert samples["vllm:prompt_tokens_cached_total"] == 32
        assert samples["vllm:num_requests_running"] == 0
        assert samples["vllm:num_requests_waiting"] == 0


async def test_metrics_show_a_running_request() -> None:
    async with sim(slow("vllm")) as s:
        task = asyncio.create_task(s.post_json("/v1/chat/completions", chat("hi", max_tokens=20)))
        await s.wait_stats(lambda st: st["running"] == 1)
        async with s.http.get(s.url + "/metrics") as resp:
            assert 'vllm:num_requests_running{model_name="sim-model"} 1.0' in await resp.text()
        await task
