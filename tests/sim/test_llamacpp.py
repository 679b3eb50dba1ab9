"""The simulator's llama.cpp dialect: slots, erase rules, RAM prompt cache, native routes."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support.sim import chat, event_json, fast, next_event, read_events, sim, slow, words

NOT_SUPPORTED = {
    "error": {
        "code": 501,
        "message": "This server does not support slots action. Start it with `--slot-save-path`",
        "type": "not_supported_error",
    }
}


async def test_identical_prompt_caches_all_but_the_last_token() -> None:
    async with sim(fast("llamacpp")) as s:
        body = chat(words(40), id_slot=0)
        assert await s.cached(body) == 0
        _, data = await s.post_json("/v1/chat/completions", body)
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 44
        assert data["timings"]["cache_n"] == 44
        assert data["timings"]["prompt_n"] == 1


async def test_cache_is_per_slot() -> None:
    async with sim(fast("llamacpp")) as s:
        await s.cached(chat(words(40), id_slot=0))
        assert await s.cached(chat(words(40), id_slot=1)) == 0


async def test_erase_without_slot_save_path_is_501() -> None:
    async with sim(fast("llamacpp")) as s:
        assert await s.post_json("/slots/0?action=erase", {}) == (501, NOT_SUPPORTED)


async def test_erase_clears_the_slot(tmp_path: Path) -> None:
    async with sim(fast("llamacpp", slot_save_path=str(tmp_path))) as s:
        body = chat(words(40), id_slot=0, max_tokens=4)
        await s.cached(body)
        assert await s.post_json("/slots/0?action=erase", {}) == (200, {"id_slot": 0, "n_erased": 49})
        assert await s.cached(body) == 0


async def test_slot_ids_wrap_modulo_the_slot_count(tmp_path: Path) -> None:
    async with sim(fast("llamacpp", slot_save_path=str(tmp_path), slots=2)) as s:
        status, data = await s.post_json("/slots/3?action=erase", {})
        assert (status, data["id_slot"]) == (200, 1)


async def test_slot_minus_one_erases_nothing(tmp_path: Path) -> None:
    async with sim(fast("llamacpp", slot_save_path=str(tmp_path))) as s:
        status, data = await s.post_json("/slots/-1?action=erase", {})
        assert (status, data["n_erased"]) == (200, 0)


async def test_non_integer_slot_id_is_400(tmp_path: Path) -> None:
    async with sim(fast("llamacpp", slot_save_path=str(tmp_path))) as s:
        assert (await s.post_json("/slots/abc?action=erase", {}))[0] == 400


# 2 s of generation at the slow simulator's 100 tokens/s: the deferred erase must be seen while it
# runs, and 20 tokens (0.2 s) were over before the check on a loaded machine once.
_BUSY_TOKENS = 200


async def test_erase_of_a_busy_slot_waits_for_its_generation(tmp_path: Path) -> None:
    async with sim(slow("llamacpp", slot_save_path=str(tmp_path))) as s:
        resp = await s.http.post(
            s.url + "/v1/chat/completions", json=chat("hi", max_tokens=_BUSY_TOKENS, stream=True, id_slot=0)
        )
        await next_event(resp)
        erase = asyncio.create_task(s.post_json("/slots/0?action=erase", {}))
        await s.wait_stats(lambda st: st["waiting"] == 1)  # the erase is deferred
        assert not erase.done()
        assert (await s.stats())["running"] == 1
        await resp.read()
        resp.release()
        status, data = await erase
        assert (status, data["id_slot"]) == (200, 0)
        assert data["n_erased"] == 6 + _BUSY_TOKENS  # the slot held prompt + generation
        assert (await s.stats())["completed_total"] == 1


async def test_ram_cache_still_hits_after_every_slot_is_erased(tmp_path: Path) -> None:
    async with sim(fast("llamacpp", slot_save_path=str(tmp_path), ram_cache=True)) as s:
        body = chat(words(40))
        await s.cached(body)
        for slot in range(2):
            assert (await s.post_json(f"/slots/{slot}?action=erase", {}))[0] == 200
        assert await s.cached(body) == 44


async def test_without_ram_cache_erasing_every_slot_is_cold(tmp_path: Path) -> None:
    async with sim(fast("llamacpp", slot_save_path=str(tmp_path))) as s:
        body = chat(words(40))
        await s.cached(body)
        for slot in range(2):
            await s.post_json(f"/slots/{slot}?action=erase", {})
        assert await s.cached(body) == 0


async def test_requests_beyond_the_slots_are_deferred() -> None:
    async with sim(slow("llamacpp", slots=1)) as s:
        tasks = [
            asyncio.create_task(s.post_json("/v1/chat/completions", chat(w, max_tokens=20))) for w in "ab"
        ]
        stats = await s.wait_stats(lambda st: st["waiting"] == 1)
        assert stats["running"] == 1
        assert [status for status, _ in await asyncio.gather(*tasks)] == [200, 200]


async def test_native_completion_tokens_cached_is_the_slot_length() -> None:
    async with sim(fast("llamacpp")) as s:
        body = {"prompt": words(30), "n_predict": 4, "id_slot": 0}
        await s.post_json("/completion", body)
        _, data = await s.post_json("/completion", body)
        assert data["tokens_cached"] == 34
        assert data["timings"]["cache_n"] == 29
        assert data["stop"] is True


async def test_completions_stream_puts_usage_on_the_finish_chunk() -> None:
    body = {"prompt": "hello", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    async with sim(fast("llamacpp")) as s, s.http.post(s.url + "/v1/completions", json=body) as resp:
        events = await read_events(resp)
    assert events[-1] == b"data: [DONE]"
    chunks = [event_json(e) for e in events[:-1]]
    assert len(chunks) == 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    assert all(c["choices"] for c in chunks)


async def test_chat_stream_usage_chunk_carries_timings() -> None:
    body = chat("hello", max_tokens=2, stream=True, stream_options={"include_usage": True})
    async with sim(fast("llamacpp")) as s, s.http.post(s.url + "/v1/chat/completions", json=body) as resp:
        events = await read_events(resp)
    usage_chunk = event_json(events[-2])
    assert usage_chunk["choices"] == []
    assert usage_chunk["timings"]["cache_n"] == 0
    assert "timings" not in event_json(events[-3])


async def test_chat_stream_without_usage_puts_timings_on_the_finish_chunk() -> None:
    body = chat("hello", max_tokens=2, stream=True)
    async with sim(fast("llamacpp")) as s, s.http.post(s.url + "/v1/chat/completions", json=body) as resp:
        events = await read_events(resp)
    finish_chunk = event_json(events[-2])
    assert finish_chunk["choices"][0]["finish_reason"] == "length"
    assert finish_chunk["timings"]["cache_n"] == 0
    assert all("timings" not in event_json(e) for e in events[:-2])


async def test_props_slots_and_health() -> None:
    async with sim(fast("llamacpp", slots=3)) as s:
        async with s.http.get(s.url + "/props") as resp:
            props = await resp.json()
        assert props["total_slots"] == 3 and props["build_info"] == "b6000-sim"
        assert props["endpoint_slots"] is True and props["endpoint_metrics"] is True
        async with s.http.get(s.url + "/slots") as resp:
            slots = await resp.json()
        assert [(x["id"], x["is_processing"], x["n_prompt_tokens"]) for x in slots] == [
            (i, False, 0) for i in range(3)
        ]
        async with s.http.get(s.url + "/health") as resp:
            assert await resp.json() == {"status": "ok"}


async def test_metrics_have_llamacpp_families() -> None:
    async with sim(fast("llamacpp")) as s:
        async with s.http.get(s.url + "/metrics") as resp:
            text = await resp.text()
        for name in (
            "llamacpp:prompt_tokens_cached_total",
            "llamacpp:requests_processing",
            "llamacpp:requests_deferred",
        ):
            assert name in text
