"""The canary sized by the engine's own tokens: its tokenizer route, else its first usage (docs/reset.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support.sidecar import stack
from tests.support.sim import fast

# The simulator's chat template around one user message: `<|im_start|> user ... <|im_end|>
# <|im_start|> assistant` (proxy/sim/text.py); mindnano's: a 16-token preamble and 5 more.
CHATML_TOKENS = 5
MINDNANO_TEMPLATE_TOKENS = 21
# A word of the simulator's --word-pieces tokenizer is 1 to 3 tokens: the last word added
# overshoots the target by at most 2.
MOST_PIECES = 3


def _calls(body: dict[str, Any], suffix: str) -> list[dict[str, Any]]:
    """The answer's engine calls to a path ending in `suffix`, each with its excerpt decoded."""
    return [
        {**call, "excerpt": orjson.loads(call["body_excerpt"])}
        for call in body["calls"]
        if call["url"].endswith(suffix)
    ]


def _prompts(body: dict[str, Any]) -> dict[str, int]:
    """Each canary request's prompt tokens, by its name."""
    return {c["excerpt"]["canary"]: c["excerpt"]["prompt"] for c in _calls(body, "/chat/completions")}


# vLLM says its block size, SGLang its page size (16 here): two blocks. llama.cpp does not: 512 tokens.
@pytest.mark.parametrize(("dialect", "target"), [("vllm", 32), ("sglang", 32), ("llamacpp", 512)])
async def test_the_canarys_words_just_reach_the_target_in_the_engines_tokens(
    tmp_path: Path, dialect: str, target: int
) -> None:
    options = {"slot_save_path": "."} if dialect == "llamacpp" else {}
    async with stack(fast(dialect, word_pieces=True, **options), tmp_path) as s:
        status, body = await s.reset()
    assert status == 200 and body["verified"] == "verified", body["verification"]
    counts = _calls(body, "/tokenize")
    assert counts and all(c["status"] == 200 for c in counts), counts
    # The counts only: never the words or their token ids.
    assert all(set(c["excerpt"]) == {"tokenize", "tokens"} for c in counts), counts
    assert {c["excerpt"]["tokenize"] for c in counts} == {"C1", "C2"}
    prompts = _prompts(body)
    assert "C1 resized" not in prompts  # counted before it was sent: no second try
    for name in ("C1", "C2"):
        words_tokens = prompts[name] - CHATML_TOKENS
        assert target <= words_tokens < target + MOST_PIECES, (name, prompts)
    assert body["verification"]["canary_tokens"] == prompts["C1"]


async def test_without_a_tokenizer_route_the_first_usage_resizes_the_canary_once(tmp_path: Path) -> None:
    # mindnano has no /tokenize and counts code points: 512 four-letter words are 2,559 tokens.
    target = 512
    async with stack(fast("mindnano"), tmp_path) as s:
        _, first = await s.reset()
        _, second = await s.reset()
    assert first["verified"] == second["verified"] == "verified"
    assert _calls(first, "/tokenize") == [] and _calls(second, "/tokenize") == []
    sent = _prompts(first)
    assert sent["C1"] == 512 * 5 - 1 + MINDNANO_TEMPLATE_TOKENS
    # Sent again at what its usage said a word costs (the template not yet known: a few tokens short).
    assert target * 0.95 <= sent["C1 resized"] - MINDNANO_TEMPLATE_TOKENS < target + 5, sent
    assert first["verification"]["canary_tokens"] == sent["C1 resized"]
    # The next reset starts from what was learned: sized at once, its words just past the target.
    again = _prompts(second)
    assert "C1 resized" not in again, again
    for name in ("C1", "C2"):
        assert target <= again[name] - MINDNANO_TEMPLATE_TOKENS < target + 5, again
