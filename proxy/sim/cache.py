"""Block-hash prefix cache of the simulator, shaped like vLLM's and SGLang's."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

__all__ = ["CacheListener", "PrefixCache", "cacheable_prefix_len"]


class CacheListener(Protocol):
    """Told of every change to the cache's contents, in order (the KV events publisher)."""

    def stored(self, hashes: list[int], parent: int | None, tokens: Sequence[str]) -> None:
        """Consecutive new blocks: their hashes, the hash before the first, their tokens."""

    def removed(self, hashes: list[int]) -> None:
        """Blocks evicted."""

    def cleared(self) -> None:
        """Every block dropped."""


def cacheable_prefix_len(n_tokens: int, block_size: int) -> int:
    """The longest block-aligned prefix a lookup may hit for a prompt of n tokens.

    Like vLLM (`KVCacheManager.get_computed_blocks`: `max_cache_hit_length =
    request.num_tokens - 1`), the last prompt token is always recomputed so that the
    engine has logits to sample from: a fully cached 32-token prompt with block 16
    reports 16 cached tokens, a 33-token one reports 32.
    """
    if n_tokens <= 0:
        return 0
    return ((n_tokens - 1) // block_size) * block_size


class PrefixCache:
    """Full blocks of tokens keyed by chained hashes, evicted least-recently-used.

    A block's hash covers its own tokens and its parent's hash, so equal hashes mean
    equal whole prefixes (as vLLM's `hash_block_tokens`). Only full blocks are cached.
    """

    __slots__ = ("_blocks", "block_size", "capacity", "listener")

    def __init__(self, block_size: int = 16, capacity_blocks: int = 4096) -> None:
        """Make an empty cache of `capacity_blocks` blocks of `block_size` tokens."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.block_size = block_size
        self.capacity = capacity_blocks
        # hash -> None; the OrderedDict's order is the LRU order (oldest first).
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.listener: CacheListener | None = None

    def __len__(self) -> int:
        """Number of cached blocks."""
        return len(self._blocks)

    def _block_hashes(self, tokens: Sequence[str], n_blocks: int, root: int = 0) -> list[int]:
        """Chained hashes of the first `n_blocks` full blocks of `tokens`, the first chained to `root`."""
        size = self.block_size
        hashes: list[int] = []
        parent = root
        for i in range(n_blocks):
            parent = hash((parent, tuple(tokens[i * size : (i + 1) * size])))
            hashes.append(parent)
        return hashes

    def lookup(self, tokens: Sequence[str], root: int = 0) -> int:
        """Cached token count for a prompt: block-aligned, never the last token.

        Refreshes the LRU position of the blocks that hit. `root` is what the first block's hash
        chains to: a salt's (vLLM mixes `cache_salt` into the first block's hash), else 0.
        """
        limit = cacheable_prefix_len(len(tokens), self.block_size) // self.block_size
        size = self.block_size
        blocks = self._blocks
        parent = root
        hit = 0
        # Hash lazily: a long prompt that misses early costs one block's hash.
        while hit < limit:
            parent = hash((parent, tuple(tokens[hit * size : (hit + 1) * size])))
            if parent not in blocks:
                break
            blocks.move_to_end(parent)
            hit += 1
        return hit * size

    def insert(self, tokens: Sequence[str], root: int = 0) -> int:
        """Cache every full block of `tokens` (chained to `root`, as `lookup`); return how many blocks were new."""
        if self.capacity == 0:
            return 0
        added = 0
        run: list[int] = []  # consecutive new blocks not yet told to the listener
        run_start, run_parent, prev = 0, None, None
        for i, block_hash in enumerate(self._block_hashes(tokens, len(tokens) // self.block_size, root)):
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                self._tell_stored(run, run_parent, tokens, run_start)
                run = []
            else:
                if not run:
                    run_start, run_parent = i, prev
                self._blocks[block_hash] = None
                run.append(block_hash)
                added += 1
                while len(self._blocks) > self.capacity:
                    evicted, _ = self._blocks.popitem(last=False)
                    # The store is told before the eviction it caused, as an engine reports them.
                    self._tell_stored(run, run_parent, tokens, run_start)
                    run = []
                    if self.listener is not None:
                        self.listener.removed([evicted])
            prev = block_hash
        self._tell_stored(run, run_parent, tokens, run_start)
        return added

    def _tell_stored(self, run: list[int], parent: int | None, tokens: Sequence[str], start: int) -> None:
        """Tell the listener of a run of new blocks starting at block `start`."""
        if run and self.listener is not None:
            size = self.block_size
            self.listener.stored(run, parent, tokens[start * size : (start + len(run)) * size])

    def clear(self) -> int:
        """Drop every block; return how many there were."""
        n = len(self._blocks)
        self._blocks.clear()
        if self.listener is not None:
            self.listener.cleared()
        return n
