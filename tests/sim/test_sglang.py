"""The simulator's SGLang dialect: /flush_cache rules, admin key, native /generate."""

from __future__ import annotations

import asyncio

from tests.support.sim import Sim, chat, fast, sim, slow, words


async def _flush(s: Sim, query: str = "", headers: dict[str, str] | None = None) -> tuple[int, str]:
    """POST /flush_cache; status and text."""
    async with s.http.post(s.url + "/flush_cache" + query, headers=headers) as resp:
        return resp.status, await resp.text()


async def test_flush_when_idle_clears_the_cache() -> None:
    async with sim(fast("sglang")) as s:
        body = chat(words(40))
        await s.cached(body)
        status, text = await _flush(s)
        assert status == 200 and text.startswith("Cache flushed.\n")
        assert await s.cached(body) == 0


async def test_flush_is_refused_with_400_while_a_request_runs() -> None:
    async with sim(slow("sglang")) as s:
        task = asyncio.create_task(s.post_json("/v1/chat/completions", chat("hi", max_tokens=20)))
        await s.wait_stats(lambda st: st["running"] == 1)
        assert await _flush(s) == (400, "Flush cache failed.\n")
        await task


async def test_flush_is_refused_while_a_request_waits() -> None:
    async with sim(slow("sglang", max_concurrency=1)) as s:
        tasks = [
            asyncio.create_task(s.post_json("/v1/chat/completions", chat(w, max_tokens=20))) for w in "ab"
        ]
        await s.wait_stats(lambda st: st["waiting"] == 1)
        assert (await _flush(s))[0] == 400
        await asyncio.gather(*tasks)


async def test_flush_with_timeout_waits_for_idle_then_succeeds() -> None:
    async with sim(slow("sglang")) as s:
        task = asyncio.create_task(s.post_json("/v1/chat/completions", chat("hi", max_tokens=20)))
        await s.wait_stats(lambda st: st["running"] == 1)
        status, text = await _flush(s, "?timeout=30")
        assert status == 200 and text.startswith("Cache flushed.")
        assert (await s.stats())["completed_total"] == 1
        assert (await task)[0] == 200


async def test_flush_timeout_expiring_is_400() -> None:
    async with sim(slow("sglang")) as s:
        resp = await s.http.post(
            s.url + "/v1/chat/completions", json=chat("hi", max_tokens=100_000, stream=True)
        )
        await s.wait_stats(lambda st: st["running"] == 1)
        assert await _flush(s, "?timeout=0.05") == (400, "Timed out waiting for idle state.")
        resp.close()


async def test_admin_api_key_guards_flush() -> None:
    async with sim(fast("sglang", admin_api_key="s3cret")) as s:
        assert (await _flush(s))[0] == 401
        assert (await _flush(s, headers={"Authorization": "Bearer wrong"}))[0] == 401
        assert (await _flush(s, headers={"Authorization": "Bearer s3cret"}))[0] == 200


async def test_server_info_routes_carry_version() -> None:
    async with sim(fast("sglang", version="0.5.10")) as s:
        for path in ("/server_info", "/get_server_info"):
            async with s.http.get(s.url + path) as resp:
                assert (await resp.json())["version"] == "0.5.10"
        async with s.http.get(s.url + "/version") as resp:
            assert resp.status == 404


async def test_generate_reports_meta_info_cached_tokens() -> None:
    async with sim(fast("sglang")) as s:
        body = {"text": words(40), "sampling_params": {"max_new_tokens": 5}}
        _, first = await s.post_json("/generate", body)
        _, second = await s.post_json("/generate", body)
        assert first["meta_info"]["cached_tokens"] == 0
        assert second["meta_info"]["cached_tokens"] == 32
        assert second["meta_info"]["prompt_tokens"] == 40
        assert second["meta_info"]["completion_tokens"] == 5
        assert isinstance(second["text"], str)


async def test_generate_streams_cumulative_text() -> None:
    async with sim(fast("sglang")) as s:
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 3}, "stream": True}
        async with s.http.post(s.url + "/generate", json=body) as resp:
            raw = await resp.read()
        events = raw[:-2].split(b"\n\n")
        assert events[-1] == b"data: [DONE]"
        assert len(events) == 4


async def test_metrics_have_sglang_families() -> None:
    async with sim(fast("sglang")) as s:
        await s.cached(chat(words(40)))
        async with s.http.get(s.url + "/metrics") as resp:
            text = await resp.text()
        for name in (
            "sglang:cached_tokens_total",
            "sglang:prompt_tokens_total",
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:cache_hit_rate",
        ):
            assert name in text
