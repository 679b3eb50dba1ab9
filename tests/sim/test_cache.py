"""The simulator's block-hash prefix cache."""

from __future__ import annotations

from proxy.sim.cache import PrefixCache, cacheable_prefix_len


def toks(n: int, tag: str = "t") -> list[str]:
    """n distinct tokens."""
    return [f"{tag}{i}" for i in range(n)]


def test_lookup_of_unknown_prompt_is_zero() -> None:
    cache = PrefixCache(block_size=16, capacity_blocks=8)
    assert cache.lookup(toks(40)) == 0


def test_hits_are_whole_blocks() -> None:
    cache = PrefixCache(block_size=16, capacity_blocks=8)
    cache.insert(toks(40))
    assert cache.lookup(toks(40) + toks(5, "x")) == 32


def test_last_prompt_token_is_never_counted() -> None:
    cache = PrefixCache(block_size=16, capacity_blocks=8)
    cache.insert(toks(32))
    assert cache.lookup(toks(32)) == 16
    assert cache.lookup(toks(33)) == 32


def test_cacheable_prefix_rule() -> None:
    assert [cacheable_prefix_len(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 0, 0, 16, 16, 32]


def test_block_hash_covers_the_whole_prefix() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=8)
    cache.insert(["a", "b", "c", "d", "e", "f", "g", "h"])
    # Same second block behind a different first block: no hit at all.
    assert cache.lookup(["z", "b", "c", "d", "e", "f", "g", "h", "i"]) == 0


def test_lru_evicts_least_recently_used_block() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=2)
    first, second, third = toks(5, "a"), toks(5, "b"), toks(5, "c")
    cache.insert(first)
    cache.insert(second)
    assert cache.lookup(first) == 4  # refreshes `first`
    cache.insert(third)  # evicts `second`, the least recently used
    assert (cache.lookup(first), cache.lookup(second), cache.lookup(third)) == (4, 0, 4)
    assert len(cache) == 2


def test_zero_capacity_caches_nothing() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=0)
    cache.insert(toks(9))
    assert cache.lookup(toks(9)) == 0


def test_clear_drops_every_block() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=8)
    cache.insert(toks(9))
    assert cache.clear() == 2
    assert cache.lookup(toks(9)) == 0
