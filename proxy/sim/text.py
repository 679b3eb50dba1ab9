"""Deterministic tokenizers, chat templates and output text of the simulator."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHATML",
    "ChatTemplate",
    "PromptError",
    "chat_prompt_tokens",
    "common_prefix",
    "completion_prompt_tokens",
    "output_tokens",
    "piece_tokenize",
    "token_ids",
    "tokenize",
]

# Words and single punctuation marks: cheap (one C-level regex pass) and stable.
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")

# Output vocabulary: printable ASCII words only.
_WORDS: tuple[str, ...] = tuple(
    (
        "the of and to in is that it for on with as was at by an be this from or "
        "have not are but had they which one you were all we can her has there been "
        "if more when will would who so no cache block prefix token model engine reset "
        "witness warm cold hit miss slot queue batch kernel layer sample decode prefill"
    ).split()
)


class PromptError(ValueError):
    """The request's prompt or messages are not in a shape the simulator accepts."""


def tokenize(text: str) -> list[str]:
    """Split text into word and punctuation tokens."""
    return _TOKEN_RE.findall(text)


def piece_tokenize(text: str) -> list[str]:
    """Word tokens split into 1 to 3 pieces by a hash of the word, as a subword tokenizer splits rare words.

    The count per word varies the way a real tokenizer's does, so a caller that sizes text by
    the engine's tokens (the sidecar's canary) cannot get it right by counting words.
    """
    pieces: list[str] = []
    for token in _TOKEN_RE.findall(text):
        n = min(len(token), 1 + _stable(token) % 3)
        step = -(-len(token) // n)
        pieces.extend(token[i : i + step] for i in range(0, len(token), step))
    return pieces


def token_ids(tokens: Sequence[str]) -> list[int]:
    """Stable ids for tokens (the shape of a `/tokenize` answer); equal tokens get equal ids."""
    return [_stable(token) % 50_000 for token in tokens]


def _stable(token: str) -> int:
    """A hash of a token that is the same in every process (Python's `hash` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=4).digest(), "little")


def _content_text(content: Any) -> str:
    """Text of a message content: a string or a list of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return " ".join(parts)
    raise PromptError("message content must be a string or a list of content parts")


@dataclass(frozen=True)
class ChatTemplate:
    """How an engine turns OpenAI messages and prompts into tokens.

    A chat prompt is the preamble, then `start role content... end` per message, then
    `start assistant`. An assistant turn in the history begins with the same two tokens
    as the generation prompt, so a conversation's prompt is a token prefix of the same
    conversation continued.
    """

    tokenize: Callable[[str], list[str]]
    preamble: tuple[str, ...] = ()
    start: str = "<|im_start|>"
    end: str = "<|im_end|>"

    def chat(self, messages: Any) -> list[str]:
        """The prompt tokens of a list of OpenAI messages."""
        if not isinstance(messages, list) or not messages:
            # Quoting the input, as pydantic's validation errors (vLLM's, SGLang's 400/422) do.
            raise PromptError(f"'messages' must be a non-empty list (input: {messages!r:.100})")
        tokens = list(self.preamble)
        for message in messages:
            if not isinstance(message, dict):
                raise PromptError("each message must be an object")
            role = message.get("role")
            if not isinstance(role, str):
                raise PromptError("each message needs a string 'role'")
            tokens.append(self.start)
            tokens.append(role)
            tokens.extend(self.tokenize(_content_text(message.get("content"))))
            tokens.append(self.end)
        tokens.append(self.start)
        tokens.append("assistant")
        return tokens

    def completion(self, prompt: Any) -> list[str]:
        """Tokens of a completions prompt: a string, a list of token ids, or a one-item list."""
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            # Token ids pass through as opaque tokens so equal id lists share a prefix.
            return [f"<{t}>" for t in prompt]
        if isinstance(prompt, list) and len(prompt) == 1:
            return self.completion(prompt[0])
        raise PromptError("'prompt' must be a string or a list of token ids (batches are not simulated)")


# The template of vLLM, SGLang, llama.cpp and plain OpenAI servers in the simulator.
CHATML = ChatTemplate(tokenize=tokenize)


def chat_prompt_tokens(messages: Any) -> list[str]:
    """Apply the ChatML template to OpenAI messages and tokenize the result."""
    return CHATML.chat(messages)


def completion_prompt_tokens(prompt: Any) -> list[str]:
    """Tokens of a completions prompt under the word tokenizer."""
    return CHATML.completion(prompt)


def common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def output_tokens(prompt: Sequence[str], count: int) -> Iterator[str]:
    """Deterministic generated tokens (each with its leading space) for a prompt."""
    digest = hashlib.blake2b("\x1f".join(prompt).encode(), digest_size=8).digest()
    state = int.from_bytes(digest, "little") | 1
    n_words = len(_WORDS)
    for _ in range(count):
        # xorshift64: fast, deterministic, good enough to vary the words.
        state ^= (state << 13) & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 7
        state ^= (state << 17) & 0xFFFFFFFFFFFFFFFF
        yield " " + _WORDS[state % n_words]
