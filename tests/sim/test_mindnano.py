"""The simulator's mindnano dialect speaks mindnano's caching semantics (issue 18).

Transport: one request at a time (429), /v1/cache/clear, /v1/cancel, /health `active`.
Cache: one entry for everyone tagged with its `user`, exact-match reuse, else 256-token
checkpoints; each worked-number row of the issue's table is one test below.
"""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.sim import SimConfig
from tests.support.sim import Sim, event_json, fast, next_event, read_events, sim, slow

MODEL = "mindnano-ling3-tiny"


def user_turn(content: str) -> list[dict[str, Any]]:
    """One user message."""
    return [{"role": "user", "content": content}]


def conversation(*turns: str) -> list[dict[str, Any]]:
    """Alternating user and assistant messages, starting with the user."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(turns)]


def body(messages: list[dict[str, Any]], max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    """A chat request to mindnano (no `model`: the engine serves one)."""
    return {"messages": messages, "max_tokens": max_tokens, **extra}


async def ask(s: Sim, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A non-stream chat completion that must succeed; its JSON body."""
    status, data = await s.post_json("/v1/chat/completions", body(messages, **extra))
    assert status == 200, data
    answer: dict[str, Any] = data
    return answer


async def cached(s: Sim, messages: list[dict[str, Any]], **extra: Any) -> int:
    """The cached tokens mindnano reports for a request."""
    cached: int = (await ask(s, messages, **extra))["mindnano_metrics"]["cached_tokens"]
    return cached


async def seed_then(s: Sim, seed: list[dict[str, Any]], target: list[dict[str, Any]]) -> int:
    """Cache `seed`, then report the cached tokens of `target`."""
    await ask(s, seed)
    return await cached(s, target)


# -- tokenizer and chat template ----------------------------------------------------------


async def test_one_user_message_of_n_code_points_is_n_plus_21_tokens() -> None:
    async with sim(fast("mindnano")) as s:
        data = await ask(s, user_turn("1" * 1003))
        assert data["usage"]["prompt_tokens"] == 1024


async def test_every_code_point_is_one_token() -> None:
    async with sim(fast("mindnano")) as s:
        # "请" is 3 UTF-8 bytes, "😀" 4; each is one code point and one token.
        data = await ask(s, user_turn("1请😀"))
        assert data["usage"]["prompt_tokens"] == 3 + 21


async def test_each_message_costs_its_content_plus_3() -> None:
    async with sim(fast("mindnano")) as s:
        data = await ask(s, conversation("12", "345", "6"))
        assert data["usage"]["prompt_tokens"] == 16 + (2 + 3) + (3 + 3) + (1 + 3) + 2


# -- worked numbers -----------------------------------------------------------------------


async def test_exact_repeat_is_wholly_cached_and_evaluates_nothing() -> None:
    async with sim(fast("mindnano")) as s:
        await ask(s, user_turn("1" * 1003))
        data = await ask(s, user_turn("1" * 1003))
        assert data["mindnano_metrics"] == {"cached_tokens": 1024, "prompt_evaluated_tokens": 0}


async def test_conversation_continued_reuses_its_1024_token_checkpoint() -> None:
    async with sim(fast("mindnano")) as s:
        reply = (await ask(s, user_turn("1" * 1003)))["choices"][0]["message"]["content"]
        target = conversation("1" * 1003, reply, "and then?")
        assert await cached(s, target) == 1024


async def test_partial_block_reuses_the_256_checkpoint() -> None:
    async with sim(fast("mindnano")) as s:
        seed = user_turn("1" * 236)
        assert (await ask(s, seed))["usage"]["prompt_tokens"] == 257
        assert await seed_then(s, seed, conversation("1" * 236, "收到", "请继续说明。")) == 256


async def test_tail_edit_keeps_the_checkpoint_before_it() -> None:
    async with sim(fast("mindnano")) as s:
        assert await seed_then(s, user_turn("1" * 300), user_turn("1" * 280 + "2" * 20)) == 256


async def test_head_edit_reuses_nothing() -> None:
    async with sim(fast("mindnano")) as s:
        assert await seed_then(s, user_turn("1" * 300), user_turn("2" + "1" * 299)) == 0


async def test_shorter_prompt_reuses_nothing() -> None:
    async with sim(fast("mindnano")) as s:
        assert await seed_then(s, user_turn("1" * 300), user_turn("1" * 11)) == 0


async def test_another_user_gets_nothing_from_the_entry() -> None:
    async with sim(fast("mindnano")) as s:
        await ask(s, user_turn("1" * 1003), user="alice")
        assert await cached(s, user_turn("1" * 1003), user="bob") == 0


async def test_checkpoint_past_the_common_prefix_is_not_reusable() -> None:
    async with sim(fast("mindnano")) as s:
        # 256 tokens, sharing 253 with the 257-token seed: the 256 checkpoint lies beyond.
        assert await seed_then(s, user_turn("1" * 236), user_turn("1" * 235)) == 0


async def test_an_unrelated_prompt_evicts_the_entry() -> None:
    async with sim(fast("mindnano")) as s:
        await ask(s, user_turn("1" * 1003))
        await ask(s, user_turn("an unrelated question"))
        assert await cached(s, user_turn("1" * 1003)) == 0


async def test_cancel_discards_the_cache() -> None:
    async with sim(slow("mindnano")) as s:
        await ask(s, user_turn("1" * 1003))
        long = body(user_turn("1" * 2979), max_tokens=100_000)
        task = asyncio.create_task(s.post_json("/v1/chat/completions", long))
        await s.wait_stats(lambda st: st["generation_tokens_total"] > 4 + 10)
        assert await s.post_json("/v1/cancel", {}) == (200, {"cancel_requested": True})
        status, answer = await task
        assert status == 409, answer
        assert answer["error"]["type"] == "cancelled"
        assert await cached(s, user_turn("1" * 1003)) == 0


# -- who reads and writes the entry -------------------------------------------------------


async def test_a_newer_user_replaces_the_entry() -> None:
    async with sim(fast("mindnano")) as s:
        await ask(s, user_turn("1" * 1003), user="alice")
        await ask(s, user_turn("1" * 1003), user="bob")
        assert await cached(s, user_turn("1" * 1003), user="alice") == 0
        assert await cached(s, user_turn("1" * 1003), user="alice") == 1024


async def test_cache_prompt_false_neither_reads_nor_writes() -> None:
    async with sim(fast("mindnano")) as s:
        await ask(s, user_turn("1" * 1003))
        assert await cached(s, user_turn("1" * 1003), cache_prompt=False) == 0
        assert await cached(s, user_turn("2" * 1003), cache_prompt=False) == 0
        assert await cached(s, user_turn("1" * 1003)) == 1024


async def test_generated_tokens_are_kept_only_with_reuse_generated_state() -> None:
    async with sim(fast("mindnano")) as s:
        seed = user_turn("1" * 1003)
        reply = (await ask(s, seed, max_tokens=100))["choices"][0]["message"]["content"]
        assert len(reply) >= 256
        continued = conversation("1" * 1003, reply, "and then?")
        assert await seed_then(s, seed, continued) == 1024
        await ask(s, seed, max_tokens=100, reuse_generated_state=True)
        assert await cached(s, continued) == (1024 + len(reply)) // 256 * 256


async def test_clear_empties_the_cache() -> None:
    async with sim(fast("mindnano")) as s:
        await ask(s, user_turn("1" * 1003))
        assert await s.post_json("/v1/cache/clear", {}) == (200, {"cleared": True})
        assert await cached(s, user_turn("1" * 1003)) == 0


# -- replies ------------------------------------------------------------------------------


async def test_cached_and_uncached_answers_have_the_same_choices() -> None:
    async with sim(fast("mindnano")) as s:
        cold = await ask(s, user_turn("1" * 1003), max_tokens=12)
        warm = await ask(s, user_turn("1" * 1003), max_tokens=12)
        assert (cold["mindnano_metrics"]["cached_tokens"], warm["mindnano_metrics"]["cached_tokens"]) == (
            0,
            1024,
        )
        assert warm["choices"] == cold["choices"]


async def test_usage_and_mindnano_metrics_agree() -> None:
    async with sim(fast("mindnano")) as s:
        await ask(s, user_turn("1" * 300))
        data = await ask(s, user_turn("1" * 280 + "2" * 20))
        usage, metrics = data["usage"], data["mindnano_metrics"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == metrics["cached_tokens"] == 256
        assert metrics["cached_tokens"] + metrics["prompt_evaluated_tokens"] == usage["prompt_tokens"] == 321


async def test_stream_finish_event_and_usage_chunk_carry_mindnano_metrics() -> None:
    async with sim(fast("mindnano")) as s:
        await ask(s, user_turn("1" * 1003))
        request = body(user_turn("1" * 1003), stream=True, stream_options={"include_usage": True})
        async with s.http.post(s.url + "/v1/chat/completions", json=request) as resp:
            events = await read_events(resp)
        finish, usage_chunk = event_json(events[-3]), event_json(events[-2])
        expected = {"cached_tokens": 1024, "prompt_evaluated_tokens": 0}
        assert finish["choices"][0]["finish_reason"] == "length"
        assert finish["mindnano_metrics"] == expected
        assert usage_chunk["choices"] == [] and usage_chunk["mindnano_metrics"] == expected
        assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 1024


async def test_model_id_is_mindnano_ling3_tiny() -> None:
    async with sim(fast("mindnano")) as s:
        async with s.http.get(s.url + "/v1/models") as resp:
            models = await resp.json()
        assert [card["id"] for card in models["data"]] == [MODEL]
        assert (await ask(s, user_turn("hi")))["model"] == MODEL


# -- transport ----------------------------------------------------------------------------


# A request that keeps the engine busy while the test acts: 2 s at the slow simulator's 100 tokens/s.
# At 20 (0.2 s) it ended before the second request arrived on a loaded machine (seen under the
# mutation audit's suite run beside CI).
BUSY_TOKENS = 200


async def test_second_request_while_busy_is_429() -> None:
    async with sim(slow("mindnano")) as s:
        task = asyncio.create_task(s.post_json("/v1/chat/completions", body(user_turn("one"), BUSY_TOKENS)))
        await s.wait_stats(lambda st: st["running"] == 1)
        status, _ = await s.post_json("/v1/chat/completions", body(user_turn("two")))
        assert status == 429
        assert (await task)[0] == 200


async def test_clear_while_busy_is_429_and_200_when_idle() -> None:
    async with sim(slow("mindnano")) as s:
        task = asyncio.create_task(s.post_json("/v1/chat/completions", body(user_turn("one"), BUSY_TOKENS)))
        await s.wait_stats(lambda st: st["running"] == 1)
        assert (await s.post_json("/v1/cache/clear", {}))[0] == 429
        await task
        assert await s.post_json("/v1/cache/clear", {}) == (200, {"cleared": True})


async def test_health_reports_active() -> None:
    async with sim(slow("mindnano")) as s:
        async with s.http.get(s.url + "/health") as resp:
            assert await resp.json() == {"status": "ok", "active": False}
        task = asyncio.create_task(s.post_json("/v1/chat/completions", body(user_turn("one"), BUSY_TOKENS)))
        await s.wait_stats(lambda st: st["running"] == 1)
        async with s.http.get(s.url + "/health") as resp:
            assert await resp.json() == {"status": "ok", "active": True}
        await task


async def test_cancel_makes_the_active_request_answer_409() -> None:
    async with sim(slow("mindnano")) as s:
        task = asyncio.create_task(s.post_json("/v1/chat/completions", body(user_turn("one"), 100_000)))
        await s.wait_stats(lambda st: st["running"] == 1)
        assert await s.post_json("/v1/cancel", {}) == (200, {"cancel_requested": True})
        status, _ = await task
        assert status == 409
        stats = await s.stats()
        assert (stats["running"], stats["aborted_total"]) == (0, 1)


async def test_cancel_during_the_prefill_answers_409_before_any_token() -> None:
    # 3,000 uncached tokens at 100 tokens/s: a prefill the cancel must cut short.
    async with sim(SimConfig(dialect="mindnano", decode_rate=0, prefill_rate=100)) as s:
        request = body(user_turn("1" * 2979), stream=True)
        task = asyncio.create_task(s.post_json("/v1/chat/completions", request))
        await s.wait_stats(lambda st: st["running"] == 1)
        assert await s.post_json("/v1/cancel", {}) == (200, {"cancel_requested": True})
        status, answer = await task
        assert status == 409 and answer["error"]["type"] == "cancelled"
        assert (await s.stats())["generation_tokens_total"] == 0


async def test_cancel_ends_an_active_stream() -> None:
    async with sim(slow("mindnano")) as s:
        request = body(user_turn("one"), max_tokens=100_000, stream=True)
        async with s.http.post(s.url + "/v1/chat/completions", json=request) as resp:
            await next_event(resp)
            await s.post_json("/v1/cancel", {})
            events = await read_events(resp)
        assert events[-1] == b"data: [DONE]"
        assert event_json(events[-2])["choices"][0]["finish_reason"] == "cancelled"


async def test_cancel_when_idle_requests_nothing_and_keeps_the_cache() -> None:
    async with sim(fast("mindnano")) as s:
        await ask(s, user_turn("1" * 1003))
        assert await s.post_json("/v1/cancel", {}) == (200, {"cancel_requested": False})
        assert await cached(s, user_turn("1" * 1003)) == 1024


async def test_a_prompt_ending_on_a_checkpoint_still_evaluates_its_last_block() -> None:
    async with sim(fast("mindnano")) as s:
        # The 1,024-token prompt is a prefix of the cached conversation: its own last
        # checkpoint (1,024) is not reusable, as the last token must be evaluated.
        await ask(s, conversation("1" * 1003, "ok", "more"))
        assert await cached(s, user_turn("1" * 1003)) == 768
