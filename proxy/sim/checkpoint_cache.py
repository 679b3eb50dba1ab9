"""mindnano's prompt cache: one entry for everyone, exact-match reuse, else 256-token checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.sim.text import common_prefix

__all__ = ["CHECKPOINT_TOKENS", "CacheEntry", "CheckpointCache"]

# mindnano saves its recurrent state every 256 tokens of a prompt.
CHECKPOINT_TOKENS = 256


@dataclass(frozen=True)
class CacheEntry:
    """The one cached prompt and the `user` it belongs to (None when the request named none)."""

    tokens: tuple[str, ...]
    user: str | None


class CheckpointCache:
    """The state of the last cached prompt, reusable whole or at a checkpoint.

    An exact repeat reuses the saved logits and state, so nothing is evaluated. Any
    other prompt can only resume from a checkpoint: the longest multiple of 256 that is
    within the common prefix and short of the new prompt's end (the last token must be
    evaluated to have logits to sample from).
    """

    __slots__ = ("entry", "interval")

    def __init__(self, interval: int = CHECKPOINT_TOKENS) -> None:
        """An empty cache with a checkpoint every `interval` tokens."""
        if interval < 1:
            raise ValueError("interval must be >= 1")
        self.interval = interval
        self.entry: CacheEntry | None = None

    def lookup(self, prompt: Sequence[str], user: str | None) -> int:
        """Prompt tokens this request may take from the cache."""
        entry = self.entry
        if entry is None or entry.user != user:
            return 0
        common = common_prefix(entry.tokens, prompt)
        if common == len(prompt) == len(entry.tokens):
            return common
        usable = max(min(common, len(prompt) - 1), 0)
        return usable // self.interval * self.interval

    def store(self, tokens: Sequence[str], user: str | None) -> None:
        """Replace the entry with this prompt (a newer request always wins)."""
        self.entry = CacheEntry(tuple(tokens), user)

    def clear(self) -> int:
        """Drop the entry; return how many tokens it held."""
        held = len(self)
        self.entry = None
        return held

    def __len__(self) -> int:
        """Tokens held."""
        return len(self.entry.tokens) if self.entry is not None else 0
