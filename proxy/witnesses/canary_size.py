"""How long the canary is, in the engine's own tokens (docs/reset.md).

The canary's words must span two of the engine's cache blocks: fewer, and its repeat cannot
show it cached; more, and every canary request prefills tokens that prove nothing more (sized
by words, the canary came to 1,298 tokens on vLLM CPU, ten of its 128-token blocks, where two
were the aim). So the words are counted by the engine itself:

- where it has a tokenizer route (vLLM and SGLang `POST /tokenize` `{"prompt"}` answer
  `count`; llama-server `POST /tokenize` `{"content"}` answers `tokens`), the words are counted
  there and trimmed or extended until they just reach the target;
- elsewhere the first canary's `usage.prompt_tokens` says what a word costs, and a canary far
  off the target is sent again at the right length.

What was learned (tokens per word, the chat template's own tokens, whether the route exists)
is kept in a `CanaryFit` for the next reset, so later resets start at the right length.
"""

from __future__ import annotations

import math
import secrets
import string
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from proxy.vocabulary import EngineKind

__all__ = [
    "FIT_ROUNDS",
    "CanaryFit",
    "Sized",
    "canary_words",
    "count_in_answer",
    "fit_words",
    "learn_template",
    "resized",
    "tokenize_request",
]

# Rounds of counting per canary: a first guess, a trim or an extension, and two to spare.
FIT_ROUNDS = 4
# A canary sized without a tokenizer is sent again when its words' tokens are off the target
# by more than this share of it.
_RESIZE_SLACK = 0.25

Count = Callable[[str], Awaitable[int | None]]


@dataclass
class CanaryFit:
    """What one engine's tokens cost per canary word, kept from reset to reset."""

    tokens_per_word: float | None = None
    template_tokens: int | None = None  # prompt_tokens beyond the words: the chat template's own
    tokenizer: bool | None = None  # the engine's tokenizer route answered (None: not asked yet)
    engine: tuple[str, str] | None = None  # the engine kind and model all this was learned from

    def serving(self, kind: str, model: str) -> None:
        """The engine serves `model` now: what was learned from another engine or model is forgotten."""
        if self.engine != (kind, model):
            self.tokens_per_word = self.template_tokens = self.tokenizer = None
            self.engine = (kind, model)

    def first_guess(self, target: int) -> int:
        """Words for `target` tokens: by what was learned, else one per token (no word is less)."""
        if self.tokens_per_word:
            return max(1, min(target, math.ceil(target / self.tokens_per_word)))
        return max(1, target)


@dataclass(frozen=True)
class Sized:
    """A canary's words, and their tokens as the engine counted them (None: not counted)."""

    words: tuple[str, ...]
    tokens: int | None

    @property
    def text(self) -> str:
        """The prompt text."""
        return " ".join(self.words)


def canary_words(n_words: int, first_letters: str) -> list[str]:
    """Fresh random words; each is at least one token in every tokenizer we know of.

    The first letter comes from `first_letters`, so two canaries differ from their first token on.
    """
    words = [secrets.choice(first_letters) + _letters(3)]
    words.extend(_more_words(n_words - 1))
    return words


def _more_words(n: int) -> list[str]:
    """`n` more random words."""
    return [_letters(4) for _ in range(n)]


def _letters(n: int) -> str:
    """n random lowercase letters."""
    return "".join(secrets.choice(string.ascii_lowercase) for _ in range(n))


def tokenize_request(kind: str, model: str | None, text: str) -> tuple[str, dict[str, Any]] | None:
    """The path and body that count `text`'s tokens on this engine, None when it has no such route."""
    if kind in (EngineKind.VLLM, EngineKind.SGLANG):
        # No BOS: the words sit inside the chat template, which has its own.
        return "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False}
    if kind == EngineKind.LLAMACPP:
        return "/tokenize", {"content": text, "add_special": False}
    return None


def count_in_answer(kind: str, answer: Any) -> int | None:
    """The token count in a tokenizer route's JSON answer, None when it has none."""
    if not isinstance(answer, dict):
        return None
    count = answer.get("count")
    if kind != EngineKind.LLAMACPP and isinstance(count, int) and not isinstance(count, bool):
        return count
    tokens = answer.get("tokens")
    return len(tokens) if isinstance(tokens, list) else None


async def fit_words(target: int, first_letters: str, count: Count, fit: CanaryFit) -> Sized:
    """The fewest fresh words whose tokens reach `target`, counted by `count` (None: it cannot).

    Each round moves the word count by what the last one measured per word; a shorter answer
    that already reached the target is kept, so the rounds cannot wander. Without a count the
    first guess is returned uncounted, for the usage to correct (`resized`).
    """
    words = canary_words(fit.first_guess(target), first_letters)
    best: Sized | None = None
    tokens = 0
    for _ in range(FIT_ROUNDS):
        tokens = await count(" ".join(words)) or 0
        if tokens <= 0:
            return best or Sized(tuple(words), None)
        per_word = tokens / len(words)
        fit.tokens_per_word = per_word
        if tokens >= target:
            if best is None or len(words) < len(best.words):
                best = Sized(tuple(words), tokens)
            surplus = math.floor((tokens - target) / per_word)
            if surplus < 1 or len(words) - surplus < 1:
                return best
            words = words[: len(words) - surplus]
        else:
            # No word is less than a token: never more words than the target's tokens.
            missing = min(max(1, math.ceil((target - tokens) / per_word)), target - len(words))
            if missing < 1 or (best is not None and len(words) + missing >= len(best.words)):
                break  # nothing shorter than the one already found reaches the target
            words.extend(_more_words(missing))
    if best is not None:
        return best
    # Still short after every round: one more word per missing token reaches it, uncounted.
    return Sized((*words, *_more_words(max(0, target - tokens))), None)


def resized(sent: Sized, prompt_tokens: int, target: int, first_letters: str, fit: CanaryFit) -> Sized | None:
    """Words at the target's length when the sent canary's usage shows it far off; None when it is close.

    Learns what the usage says. With a count from the tokenizer the template's own tokens are
    what the usage has beyond it (kept, nothing resized). Without one, a word costs the prompt's
    tokens less the template's (when known) over the words sent.
    """
    if sent.tokens is not None:
        fit.template_tokens = max(0, prompt_tokens - sent.tokens)
        return None
    words_tokens = prompt_tokens - (fit.template_tokens or 0)
    fit.tokens_per_word = max(words_tokens / len(sent.words), 1e-9)
    if target <= words_tokens <= target * (1 + _RESIZE_SLACK):
        return None
    return Sized(tuple(canary_words(fit.first_guess(target), first_letters)), None)


def learn_template(
    first: Sized, first_prompt: int, second: Sized, second_prompt: int, fit: CanaryFit
) -> None:
    """Two uncounted canaries of different lengths: what a word costs and what the template adds."""
    if len(first.words) == len(second.words):
        return
    per_word = (first_prompt - second_prompt) / (len(first.words) - len(second.words))
    if per_word <= 0:
        return
    fit.tokens_per_word = per_word
    fit.template_tokens = max(0, round(second_prompt - per_word * len(second.words)))
