"""The k-way merge by `at_ns` of several evidence sources (the two files `GET /cache/evidence` reads)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import AsyncExitStack, aclosing
from pathlib import Path
from typing import Any

import orjson

from proxy.evidence.reader import read_evidence_blocks

__all__ = ["merge_blocks", "read_merged"]


def _at_ns(line: bytes) -> int | None:
    """A line's `at_ns`, None when it has none (another shape, or not JSON)."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    value = record.get("at_ns") if isinstance(record, dict) else None
    return value if isinstance(value, int) else None


def _key(line: bytes, before: int) -> int:
    """The merge key: `at_ns`; a line without one keeps its place after the line `before` it."""
    at_ns = _at_ns(line)
    return before if at_ns is None else at_ns


def _last_key(lines: list[bytes], start: int, before: int) -> int:
    """The key of the last of `lines[start:]`: the last `at_ns` among them (parsed from the end)."""
    for line in reversed(lines[start:]) if start else reversed(lines):
        at_ns = _at_ns(line)
        if at_ns is not None:
            return at_ns
    return before


class _Source:
    """One file's blocks of lines, read ahead by one block: the next line and its `at_ns`."""

    def __init__(self, index: int, blocks: AsyncGenerator[list[bytes], None]) -> None:
        self.index = index
        self.blocks = blocks
        self.lines: list[bytes] = []
        self.pos = 0
        self.at_ns = 0

    async def fill(self) -> bool:
        """Make sure a line is next (reading the next block); False at the end."""
        while self.pos >= len(self.lines):
            block = await anext(self.blocks, None)
            if block is None:
                return False
            self.lines, self.pos = block, 0
            self.at_ns = _key(block[0], self.at_ns)
        return True

    def take_before(self, bound: tuple[int, int]) -> list[bytes]:
        """The lines of this block that come before `bound` (`(at_ns, source index)`): at least one,
        the first being the smallest of all sources'. A block that ends before it goes whole,
        parsed at its last line only."""
        last = _last_key(self.lines, self.pos, self.at_ns)
        if (last, self.index) < bound:
            taken = self.lines[self.pos :] if self.pos else self.lines
            self.pos, self.at_ns = len(self.lines), last
            return taken
        start = self.pos
        while True:  # the first line always: every round takes one at least
            self.pos += 1
            if self.pos == len(self.lines):
                break
            self.at_ns = _key(self.lines[self.pos], self.at_ns)
            if (self.at_ns, self.index) >= bound:
                break
        return self.lines[start : self.pos]


async def merge_blocks(
    sources: Sequence[AsyncGenerator[list[bytes], None]],
) -> AsyncGenerator[tuple[int, list[bytes]], None]:
    """Several sources' blocks of lines merged by `at_ns`: (index of the source, lines).

    A k-way merge that keeps each source's own order: of the sources' next lines the one with
    the smallest `at_ns` goes first (ties: the earlier source). It works a block (a chunk read)
    at a time: the long runs of observations between two resets pass whole, each block parsed
    at its first and last line, and a source left alone passes unparsed.
    """
    live: list[_Source] = []
    for index, blocks in enumerate(sources):
        source = _Source(index, blocks)
        if await source.fill():
            live.append(source)
    while len(live) > 1:
        first = min(live, key=lambda s: (s.at_ns, s.index))
        yield first.index, first.take_before(min((s.at_ns, s.index) for s in live if s is not first))
        if not await first.fill():
            live.remove(first)
    for source in live:
        yield source.index, source.lines[source.pos :]
        async for block in source.blocks:
            yield source.index, block


async def read_merged(
    sources: Sequence[tuple[Path, int]], **filters: Any
) -> AsyncGenerator[list[bytes], None]:
    """The matching lines of several evidence files (each `(path, keep)`), merged by `at_ns`, in blocks."""
    async with AsyncExitStack() as stack:
        blocks = [
            await stack.enter_async_context(aclosing(read_evidence_blocks(path, keep=keep, **filters)))
            for path, keep in sources
        ]
        merged = await stack.enter_async_context(aclosing(merge_blocks(blocks)))
        async for _, block in merged:
            yield block
