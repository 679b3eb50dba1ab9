"""Each simulated engine honours its isolation field as the engine does, over real sockets.

vLLM: a salted request shares nothing with an unsalted or differently salted one (the salt keys
the first block's hash); SGLang: `cache_salt` and `extra_key` the same; llama.cpp and mindnano:
`cache_prompt: false` reuses nothing. `--ignore-isolation` makes the engine cache anyway.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.sim import chat, fast, sim, words

PROMPT = words(40)


def _cached(data: dict[str, Any]) -> int:
    """Cached tokens of a non-stream answer (any dialect's field)."""
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        return int(details["cached_tokens"])
    return int(data["timings"]["cache_n"])


async def _ask(engine: Any, **fields: Any) -> int:
    status, data = await engine.post_json("/v1/chat/completions", chat(PROMPT, 2, **fields))
    assert status == 200, data
    return _cached(data)


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_a_salted_request_shares_nothing_with_another_salt(dialect: str) -> None:
    async with sim(fast(dialect)) as engine:
        assert await _ask(engine) == 0
        assert await _ask(engine) > 0  # unsalted: the repeat hits
        assert await _ask(engine, cache_salt="a") == 0  # the unsalted blocks are not its
        assert await _ask(engine, cache_salt="b") == 0  # nor another salt's
        assert await _ask(engine, cache_salt="a") > 0  # its own salt's are


async def test_sglang_extra_key_keys_the_cache_as_the_salt_does() -> None:
    async with sim(fast("sglang")) as engine:
        assert await _ask(engine, extra_key="k") == 0
        assert await _ask(engine) == 0
        assert await _ask(engine, extra_key="k") > 0


async def test_sglang_generate_reads_extra_key() -> None:
    async with sim(fast("sglang")) as engine:

        async def generate(key: str) -> int:
            body = {"text": PROMPT, "extra_key": key, "sampling_params": {"max_new_tokens": 2}}
            status, data = await engine.post_json("/generate", body)
            assert status == 200, data
            return int(data["meta_info"]["cached_tokens"])

        assert await generate("k") == 0
        assert await generate("k") > 0
        assert await generate("other") == 0


@pytest.mark.parametrize(
    ("salt", "said"),
    [("", "non-empty"), (5, "non-empty"), ("a/b", "at most 128"), ("x" * 129, "at most 128")],
)
async def test_vllm_refuses_a_salt_outside_its_rules(salt: object, said: str) -> None:
    async with sim(fast("vllm")) as engine:
        status, data = await engine.post_json("/v1/chat/completions", chat(PROMPT, 2, cache_salt=salt))
        assert status == 400
        assert said in data["error"]["message"]


@pytest.mark.parametrize("dialect", ["llamacpp", "mindnano"])
async def test_cache_prompt_false_reuses_nothing(dialect: str) -> None:
    async with sim(fast(dialect, **({"slots": 1} if dialect == "llamacpp" else {}))) as engine:
        assert await _ask(engine) == 0
        assert await _ask(engine, cache_prompt=False) == 0
        assert await _ask(engine, cache_prompt=False) == 0


@pytest.mark.parametrize(
    ("dialect", "fields"),
    [
        ("vllm", {"cache_salt": "s1"}),
        ("sglang", {"cache_salt": "s1"}),
        ("llamacpp", {"cache_prompt": False}),
        ("mindnano", {"cache_prompt": False}),
    ],
)
async def test_ignore_isolation_caches_anyway(dialect: str, fields: dict[str, Any]) -> None:
    options = {"slots": 1} if dialect == "llamacpp" else {}
    async with sim(fast(dialect, ignore_isolation=True, **options)) as engine:
        await _ask(engine)
        assert await _ask(engine, **fields) > 0
        if "cache_salt" in fields:
            assert await _ask(engine, cache_salt="s2") > 0
