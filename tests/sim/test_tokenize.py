"""The simulator's tokenizer routes: the same count as its chat and completion routes use."""

from __future__ import annotations

import pytest

from tests.support.sim import chat, fast, sim

TEXT = "a canary of several words, unevenly split"
CHATML_TOKENS = 5  # `<|im_start|> user` ... `<|im_end|> <|im_start|> assistant`


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "llamacpp"])
@pytest.mark.parametrize("word_pieces", [False, True])
async def test_tokenize_counts_what_a_chat_request_prefills(dialect: str, word_pieces: bool) -> None:
    async with sim(fast(dialect, word_pieces=word_pieces)) as s:
        body = {"content": TEXT} if dialect == "llamacpp" else {"model": "sim-model", "prompt": TEXT}
        status, counted = await s.post_json("/tokenize", body)
        _, answer = await s.post_json("/v1/chat/completions", chat(TEXT, 1))
    assert status == 200, counted
    tokens = len(counted["tokens"])
    assert counted.get("count", tokens) == tokens
    assert tokens + CHATML_TOKENS == answer["usage"]["prompt_tokens"]
    # Seven words and a comma; the subword mode splits words into more.
    assert tokens > 8 if word_pieces else tokens == 8


async def test_vllm_tokenize_of_messages_counts_the_chat_template() -> None:
    async with sim(fast("vllm", word_pieces=True)) as s:
        request = chat(TEXT, 1)
        _, counted = await s.post_json("/tokenize", {"model": "sim-model", "messages": request["messages"]})
        _, answer = await s.post_json("/v1/chat/completions", request)
    assert counted["count"] == answer["usage"]["prompt_tokens"]


async def test_llamacpp_tokenize_pieces_and_a_body_without_content() -> None:
    async with sim(fast("llamacpp", word_pieces=True)) as s:
        _, pieces = await s.post_json("/tokenize", {"content": "abcdef", "with_pieces": True})
        assert await s.post_json("/tokenize", {"prompt": "abcdef"}) == (200, {"tokens": []})
    assert "".join(p["piece"] for p in pieces["tokens"]) == "abcdef"
    assert all(isinstance(p["id"], int) for p in pieces["tokens"])
