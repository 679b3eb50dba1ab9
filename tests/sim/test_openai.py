"""The simulator's OpenAI surface: responses, streaming framing, aborts, concurrency."""

from __future__ import annotations

import asyncio

import openai
import orjson
import pytest

from proxy.sim import DIALECTS
from tests.support.sim import chat, event_json, fast, next_event, read_events, sim, slow, words


async def test_repeated_prompt_hits_whole_blocks_over_http() -> None:
    async with sim(fast("openai")) as s:
        body = chat(words(40))  # 40 words + 5 template tokens = 45 prompt tokens
        assert await s.cached(body) == 0
        assert await s.cached(body) == 32


async def test_usage_counts_prompt_and_completion() -> None:
    async with sim(fast("openai")) as s:
        status, data = await s.post_json("/v1/chat/completions", chat(words(10), max_tokens=7))
        assert status == 200
        assert data["usage"]["prompt_tokens"] == 15
        assert data["usage"]["completion_tokens"] == 7
        assert data["usage"]["total_tokens"] == 22


async def test_max_tokens_defaults_to_16() -> None:
    async with sim(fast("openai")) as s:
        body = chat("hi")
        del body["max_tokens"]
        _, data = await s.post_json("/v1/chat/completions", body)
        assert data["usage"]["completion_tokens"] == 16
        assert data["choices"][0]["finish_reason"] == "length"


async def test_output_is_deterministic_printable_ascii() -> None:
    async with sim(fast("openai")) as s:
        _, one = await s.post_json("/v1/chat/completions", chat("same prompt", max_tokens=12))
        _, two = await s.post_json("/v1/chat/completions", chat("same prompt", max_tokens=12))
        _, other = await s.post_json("/v1/chat/completions", chat("other prompt", max_tokens=12))
        text = one["choices"][0]["message"]["content"]
        assert text == two["choices"][0]["message"]["content"]
        assert text != other["choices"][0]["message"]["content"]
        assert text.isascii() and text.isprintable()


async def test_completions_route_answers_text_completion() -> None:
    async with sim(fast("openai")) as s:
        status, data = await s.post_json(
            "/v1/completions", {"model": "m", "prompt": words(20), "max_tokens": 3}
        )
        assert status == 200
        assert data["object"] == "text_completion"
        assert data["usage"]["completion_tokens"] == 3
        assert isinstance(data["choices"][0]["text"], str)


async def test_bad_messages_are_400() -> None:
    async with sim(fast("openai")) as s:
        status, data = await s.post_json("/v1/chat/completions", {"model": "m", "messages": "nope"})
        assert status == 400
        assert "messages" in data["error"]["message"]


# The engines' own owners: trtllm-serve's ModelCard default, Dynamo's openai.rs ModelListing.
OWNERS = {"trtllm": "tensorrt_llm", "dynamo": "nvidia"}


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_models_owned_by_names_the_dialect(dialect: str) -> None:
    async with sim(fast(dialect)) as s, s.http.get(s.url + "/v1/models") as resp:
        data = await resp.json()
        assert data["data"][0]["id"] == ("mindnano-ling3-tiny" if dialect == "mindnano" else "sim-model")
        assert data["data"][0]["owned_by"] == OWNERS.get(dialect, dialect)


async def test_stream_without_include_usage_has_no_usage_member() -> None:
    async with sim(fast("openai")) as s:
        async with s.http.post(
            s.url + "/v1/chat/completions", json=chat("hi", max_tokens=3, stream=True)
        ) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = await read_events(resp)
        assert events[-1] == b"data: [DONE]"
        chunks = [event_json(e) for e in events[:-1]]
        assert all("usage" not in c for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, None, "length"]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


async def test_stream_with_include_usage_has_openai_framing() -> None:
    body = chat(words(40), max_tokens=3, stream=True, stream_options={"include_usage": True})
    async with sim(fast("openai")) as s:
        await s.cached(chat(words(40)))
        async with s.http.post(s.url + "/v1/chat/completions", json=body) as resp:
            events = await read_events(resp)
        assert events[-1] == b"data: [DONE]"
        chunks = [event_json(e) for e in events[:-1]]
        *content, usage_chunk = chunks
        assert all(c["usage"] is None for c in content)
        assert b'"usage":null' in events[0]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == 3
        assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in content).strip()


async def test_stream_delivers_each_token_while_generation_runs() -> None:
    async with sim(slow("openai")) as s:
        body = chat("hi", max_tokens=300, stream=True)
        async with s.http.post(s.url + "/v1/chat/completions", json=body) as resp:
            role = event_json(await next_event(resp))
            first = event_json(await next_event(resp))
            assert role["choices"][0]["delta"]["role"] == "assistant"
            assert first["choices"][0]["delta"]["content"].strip()
            # The first token arrived while the engine still generates the rest.
            assert (await s.stats())["running"] == 1


async def test_client_disconnect_aborts_the_sequence() -> None:
    async with sim(slow("openai")) as s:
        resp = await s.http.post(
            s.url + "/v1/chat/completions", json=chat("hi", max_tokens=1000, stream=True)
        )
        await next_event(resp)
        resp.close()
        stats = await s.wait_stats(lambda st: st["aborted_total"] == 1)
        assert stats["running"] == 0
        assert stats["completed_total"] == 0


async def test_max_concurrency_makes_extra_requests_wait() -> None:
    async with sim(slow("openai", max_concurrency=1)) as s:
        first = asyncio.create_task(s.post_json("/v1/chat/completions", chat("one", max_tokens=30)))
        second = asyncio.create_task(s.post_json("/v1/chat/completions", chat("two", max_tokens=30)))
        stats = await s.wait_stats(lambda st: st["waiting"] == 1)
        assert stats["running"] == 1
        assert [(await first)[0], (await second)[0]] == [200, 200]
        assert (await s.stats())["completed_total"] == 2


async def test_official_openai_sdk_streams_with_usage() -> None:
    async with sim(fast("vllm")) as s:
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none")
        try:
            stream = await client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": "hello there"}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
        finally:
            await client.close()
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 5


async def test_unknown_route_is_fastapi_404() -> None:
    async with sim(fast("openai")) as s, s.http.post(s.url + "/reset_prefix_cache") as resp:
        assert resp.status == 404
        assert orjson.loads(await resp.read()) == {"detail": "Not Found"}


async def test_client_disconnect_aborts_a_non_stream_request() -> None:
    async with sim(slow("openai")) as s:
        task = asyncio.create_task(s.post_json("/v1/chat/completions", chat("hi", max_tokens=100_000)))
        await s.wait_stats(lambda st: st["running"] == 1)
        task.cancel()
        stats = await s.wait_stats(lambda st: st["aborted_total"] == 1)
        assert stats["running"] == 0


async def test_client_disconnect_while_waiting_leaves_no_waiter() -> None:
    async with sim(slow("openai", max_concurrency=1)) as s:
        first = asyncio.create_task(s.post_json("/v1/chat/completions", chat("one", max_tokens=20)))
        second = asyncio.create_task(s.post_json("/v1/chat/completions", chat("two", max_tokens=20)))
        await s.wait_stats(lambda st: st["waiting"] == 1)
        second.cancel()
        await s.wait_stats(lambda st: st["waiting"] == 0)
        assert (await first)[0] == 200
        stats = await s.wait_stats(lambda st: st["running"] == 0)
        assert stats["completed_total"] == 1
