"""The official openai SDK works through the sidecar unchanged, against each real engine."""

from __future__ import annotations

import openai
from openai.types.chat import ChatCompletionMessageParam

from tests.real.conftest import Pair

MODEL = "tiny"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]
MAX_TOKENS = 8


def _client(pair: Pair) -> openai.OpenAI:
    """A sync client on the sidecar (the engines take no key; the SDK needs one)."""
    return openai.OpenAI(base_url=f"{pair.url}/v1", api_key="not-used", max_retries=0, timeout=60)


def _async_client(pair: Pair) -> openai.AsyncOpenAI:
    """An async client on the sidecar."""
    return openai.AsyncOpenAI(base_url=f"{pair.url}/v1", api_key="not-used", max_retries=0, timeout=60)


def test_sync_chat_completion(any_engine: Pair) -> None:
    """client.chat.completions.create returns a parsed completion with usage."""
    with _client(any_engine) as client:
        done = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert done.choices[0].message.content
    assert done.usage is not None and done.usage.completion_tokens == MAX_TOKENS


def test_sync_chat_stream(any_engine: Pair) -> None:
    """A sync stream yields content chunks and no usage chunk the client did not ask for."""
    with _client(any_engine) as client:
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
    assert chunks and all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks)


async def test_async_chat_completion(any_engine: Pair) -> None:
    """AsyncOpenAI's chat.completions.create returns a parsed completion with usage."""
    async with _async_client(any_engine) as client:
        done = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert done.choices[0].message.content
    assert done.usage is not None and done.usage.completion_tokens == MAX_TOKENS


async def test_async_stream_with_usage_asked_keeps_it(any_engine: Pair) -> None:
    """An async stream that asks for include_usage still gets its usage chunk (nothing injected to strip)."""
    async with _async_client(any_engine) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
