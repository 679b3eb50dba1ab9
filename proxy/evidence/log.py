"""The evidence as two files: the observations, and the reset records that traffic cannot rotate away.

Every `infer.cache_state` record (pod and cluster resets, slot erases) and every
`infer.cache_verification` goes to `evidence_resets_path`, rotated by its own size and keep;
everything else to `evidence`. Only an admin call, or the verdict that follows one, writes a
reset record, so clients flooding the sidecar rotate the observation file and never the resets.
`GET /cache/evidence` reads both merged by `at_ns`: one stream, as before the split.

Records of requests the sidecar refused itself (400, 413, 503: no engine work, so the cheapest
to send) are also bounded in rate, `evidence_rejected_per_s`; those past it are counted in
`evidence_dropped_total{reason="rate"}`, never written.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, aclosing
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from proxy.config import SETTINGS
from proxy.evidence.writer import DropReason, EvidenceWriter, read_evidence_blocks

__all__ = ["EVIDENCE", "RESET_EVENTS", "EvidenceLog", "RateBound", "read_merged", "setup_evidence"]

# Records a flood of observations must not rotate away: resets, verdicts, the index at case starts,
# the counter witness's reconciliations and the engine's events.
RESET_EVENTS = frozenset(
    {
        "infer.cache_state",
        "infer.cache_verification",
        "infer.cache_blocks",
        "infer.cache_reconciliation",
        "infer.engine_event",
    }
)
# Reset records waiting for a full disk, at most (and at most evidence_queue_max_bytes): they
# are few and small (only admin calls write them), so this adds little to the observations' bound.
_RESETS_QUEUE_BYTES = 4 * 1024 * 1024


class RateBound:
    """A token bucket: `rate` a second on average, bursts of one second's worth; 0 = no bound."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        """Start full."""
        self.rate = rate
        self._burst = max(rate, 1.0)
        self._tokens = self._burst
        self._clock = clock
        self._at = clock()

    def take(self) -> bool:
        """Whether one more event fits now (and count it)."""
        if self.rate <= 0:
            return True
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class EvidenceLog:
    """Both evidence writers behind one `write`: each record to its file, counters summed over both."""

    def __init__(
        self, observations: EvidenceWriter, resets: EvidenceWriter, *, rejected_per_s: float
    ) -> None:
        """Route to the two writers; refused requests' records bounded to `rejected_per_s`."""
        self.observations = observations
        self.resets = resets
        self._rejected = RateBound(rejected_per_s)
        self._writers = (observations, resets)

    def write(self, record: dict[str, Any]) -> None:
        """Enqueue one record in its file; never blocks, never raises."""
        writer = self.resets if record.get("event_type") in RESET_EVENTS else self.observations
        writer.write(record)

    def write_rejected(self, record: dict[str, Any]) -> None:
        """The record of a request the sidecar refused itself, within the rate bound (else counted)."""
        if self._rejected.take():
            self.observations.write(record)
        else:
            self.observations.drop(DropReason.RATE, str(record.get("event_type", "unknown")))

    async def start(self) -> None:
        """Start both flush tasks."""
        for writer in self._writers:
            await writer.start()

    async def flush(self) -> None:
        """Write every record queued so far, in both files."""
        for writer in self._writers:
            await writer.flush()

    async def close(self) -> None:
        """Flush, fsync and close both files."""
        for writer in self._writers:
            await writer.close()

    @property
    def records_total(self) -> dict[str, int]:
        """Records written, by event type, both files."""
        total: dict[str, int] = {}
        for writer in self._writers:
            # A copy: the writer's thread adds keys (dict() copies atomically under the GIL).
            for event_type, count in dict(writer.records_total).items():
                total[event_type] = total.get(event_type, 0) + count
        return total

    @property
    def dropped(self) -> dict[DropReason, int]:
        """Records that will never be written, by reason, both files."""
        return {reason: sum(w.dropped[reason] for w in self._writers) for reason in DropReason}

    @property
    def dropped_total(self) -> int:
        """Records that will never be written, all reasons."""
        return sum(w.dropped_total for w in self._writers)

    @property
    def write_errors_total(self) -> int:
        """Writes the disk refused, both files."""
        return sum(w.write_errors_total for w in self._writers)

    @property
    def pending_bytes(self) -> int:
        """Bytes written to no file yet, both files."""
        return sum(w.pending_bytes for w in self._writers)

    def read(self, **filters: Any) -> AsyncIterator[list[bytes]]:
        """The matching lines of both files, in blocks (see `read_merged`)."""
        sources = [(w.path, w.keep) for w in self._writers]
        return read_merged(sources, **filters)


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


async def read_merged(
    sources: Sequence[tuple[Path, int]], **filters: Any
) -> AsyncGenerator[list[bytes], None]:
    """The matching lines of several evidence files (each `(path, keep)`), merged by `at_ns`, in blocks.

    A k-way merge that keeps each file's own order: of the sources' next lines the one with
    the smallest `at_ns` goes first (ties: the earlier source). It works a block (a chunk read)
    at a time: the long runs of observations between two resets pass whole, each block parsed
    at its first and last line, and a file left alone passes unparsed.
    """
    async with AsyncExitStack() as stack:
        live: list[_Source] = []
        for index, (path, keep) in enumerate(sources):
            blocks = await stack.enter_async_context(
                aclosing(read_evidence_blocks(path, keep=keep, **filters))
            )
            source = _Source(index, blocks)
            if await source.fill():
                live.append(source)
        while len(live) > 1:
            first = min(live, key=lambda s: (s.at_ns, s.index))
            yield first.take_before(min((s.at_ns, s.index) for s in live if s is not first))
            if not await first.fill():
                live.remove(first)
        for source in live:
            yield source.lines[source.pos :]
            async for block in source.blocks:
                yield block


EVIDENCE = web.AppKey("evidence", EvidenceLog)


def setup_evidence(app: web.Application) -> None:
    """The evidence writers: started first, closed (flushed, fsync'd) after everything that records."""
    settings = app[SETTINGS]
    observations = EvidenceWriter(
        Path(settings.evidence),
        max_bytes=settings.evidence_max_bytes,
        keep=settings.evidence_keep,
        stdout=settings.evidence_stdout,
        max_queue_bytes=settings.evidence_queue_max_bytes,
    )
    resets = EvidenceWriter(
        Path(settings.resets_evidence),
        max_bytes=settings.evidence_resets_max_bytes,
        keep=settings.evidence_resets_keep,
        stdout=settings.evidence_stdout,
        max_queue_bytes=min(settings.evidence_queue_max_bytes, _RESETS_QUEUE_BYTES),
    )
    log = EvidenceLog(observations, resets, rejected_per_s=settings.evidence_rejected_per_s)
    app[EVIDENCE] = log

    async def lifetime(_app: web.Application) -> AsyncIterator[None]:
        await log.start()
        yield
        await log.close()

    app.cleanup_ctx.append(lifetime)
