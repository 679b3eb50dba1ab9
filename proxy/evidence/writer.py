"""The evidence writer: async, batched, chained JSONL into one file and its rotations (the file
itself is proxy/evidence/rotating.py's; the two files the sidecar keeps are in
proxy/evidence/log.py; reading them is proxy/evidence/reader.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

from proxy import __version__
from proxy.evidence.chain import (
    Chain,
    Mark,
    find_predecessor,
)
from proxy.evidence.keys import SigningKey
from proxy.evidence.lines import CHAIN_SUFFIX_MAX, encode_record
from proxy.evidence.reader import evidence_files
from proxy.evidence.rotating import RotatingFile, log_event
from proxy.vocabulary import EventType

__all__ = ["DropReason", "EvidenceWriter"]


class DropReason(StrEnum):
    """Why an evidence record will never be written (`evidence_dropped_total{reason}`)."""

    QUEUE_FULL = "queue_full"  # the disk refuses and the queue holds its bytes bound
    RECORD_TOO_LARGE = "record_too_large"
    UNENCODABLE = "unencodable"
    WRITER_CLOSED = "writer_closed"
    UNWRITABLE_AT_CLOSE = "unwritable_at_close"  # still refused by the disk at shutdown
    RATE = "rate"  # a refused request's record past evidence_rejected_per_s (proxy/evidence/log.py)


# Queued in place of a line: a checkpoint, built and signed by the writer's thread. A record's
# line starts with "{"; a marker with NUL, then P (periodic) or F (final), then its at_ns, taken
# when it is queued so that the file stays in at_ns order as far as the records do.
_MARKER = 0
_PERIODIC, _FINAL = b"P", b"F"
# What a record queued unbuilt (`write_later`) counts in the queue's bound until it is built at
# the flush (then its line's own length): an observation's line is 0.6-0.9 KB. A longer one
# (a model name of kilobytes) is undercounted until the flush (at most 2 × flush_interval_s).
_LATER_BYTES = 1024

# A record queued unbuilt: made into its dict, then its line, at the flush.
Build = Callable[[], dict[str, Any]]


class EvidenceWriter:
    """Append-only JSONL evidence: `write()` enqueues, a task flushes batches in a thread.

    Nothing here blocks the event loop or raises into the proxy. Records waiting to be
    written are bounded in bytes (`max_queue_bytes`): past it a new record is dropped.
    A disk error is counted and logged once per kind; the lines that fit are written and
    the rest are retried with the next flush (when space returns). Every record is either
    written, waiting, or counted in `dropped` by reason, exactly. Lines are never split:
    a line cut by a failed write is truncated off and written again whole.

    The thread also chains the lines (proxy/evidence/chain.py): numbers and links each, opens
    the writer's life with an `infer.evidence_opened`, appends a checkpoint (signed by `signer`)
    every `checkpoint_interval_s` while records come and at close, and hands the count of
    records dropped since the last one queued to the next as `dropped_before`.
    """

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int = 64 * 1024 * 1024,
        keep: int = 5,
        stdout: bool = False,
        flush_interval_s: float = 0.4,
        max_queue_bytes: int = 32 * 1024 * 1024,
        checkpoint_interval_s: float = 10.0,
        signer: SigningKey | None = None,
    ) -> None:
        """Configure; nothing is opened until the first batch."""
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self.stdout = stdout
        self.flush_interval_s = flush_interval_s
        self.max_queue_bytes = max_queue_bytes
        self.checkpoint_interval_s = checkpoint_interval_s
        self.signer = signer
        self._file = RotatingFile(self.path, max_bytes=max_bytes, keep=keep, stdout=stdout)
        self._flush_errors = 0  # flushes that failed outside the file's own writes
        self.dropped: dict[DropReason, int] = dict.fromkeys(DropReason, 0)
        # (event type, encoded record, a checkpoint marker or a record to build, records dropped just before it)
        self._queue: collections.deque[tuple[str, bytes | Build, int]] = collections.deque()
        self._unwritten: list[tuple[str, bytes]] = []  # what the disk refused, retried first
        # Bytes of the lines waiting: queued, being written by the thread, refused by the disk.
        self._queued_bytes = 0
        self._flushing_bytes = 0
        self._unwritten_bytes = 0
        self._flush_lock = asyncio.Lock()
        self._wake = asyncio.Event()  # flush now: due, a burst, or close
        # While nothing waits to be written the task sleeps on `_arrived` (no timer): the
        # first record then sets it. Set on every arrival; the task clears it just before it
        # sleeps, so a stale set costs nothing.
        self._arrived = asyncio.Event()
        # When the oldest record waiting was queued (monotonic; None: none waits). A flush is due
        # once it is flush_interval_s old, and the record that finds it so wakes the task: under
        # traffic no timer wakes the loop for a flush (at a paced load each wake-up of an idle
        # process costs more CPU than a request's records, issue 34). With no record after it,
        # the task's own timer writes it 2 × flush_interval_s after it came, at the latest.
        self._oldest_at: float | None = None
        self._periodic_flushes = 0
        self._flushed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._logged_drops: set[str] = set()  # touched by the event loop only
        self._gap = 0  # records dropped since the last one queued (event loop)
        self._since_checkpoint = 0  # records queued since the last checkpoint (event loop)
        self._checkpoint_at = time.monotonic()
        # Told of each file a rotation dropped (`describe_dropped`), on the loop after the flush.
        self.on_rotated: Callable[[dict[str, Any]], None] | None = None
        self._chain: Chain | None = None  # the writer's thread's, from its first batch on
        self._mark: Mark | None = None  # the last line written, while nothing chained waits

    @property
    def records_total(self) -> dict[str, int]:
        """Records written to the file whole, by event type."""
        return self._file.records_total

    @property
    def write_errors_total(self) -> int:
        """Failed writes, fsyncs and flushes."""
        return self._file.write_errors_total + self._flush_errors

    @property
    def dropped_total(self) -> int:
        """Records that will never be written, all reasons."""
        return sum(self.dropped.values())

    @property
    def pending_bytes(self) -> int:
        """Bytes of the records written to no file yet."""
        return self._queued_bytes + self._flushing_bytes + self._unwritten_bytes

    async def start(self) -> None:
        """Open the chain (its opening line goes first, dated now) and start the periodic flush task."""
        async with self._flush_lock:
            if self._chain is None:
                chain = await asyncio.to_thread(self._open_chain)
                opened = chain.opened(version=__version__, file=self.path.name)
                self._chain = chain
                self._unwritten.append((str(EventType.EVIDENCE_OPENED), opened))
                self._unwritten_bytes += len(opened)
                self._since_checkpoint += 1  # the next checkpoint covers the opening too
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="evidence-writer")

    def write(self, record: dict[str, Any]) -> None:
        """Enqueue one record; never blocks, never raises."""
        try:
            event_type = str(record.get("event_type", "unknown"))
            if self._closed:
                self.drop(DropReason.WRITER_CLOSED, event_type)
                return
            line = encode_record(record)
            if line is None:
                self.drop(DropReason.RECORD_TOO_LARGE, event_type)
                return
            # Counted at the size it will have once chained, so that the bound holds after too.
            self._enqueue(event_type, line, len(line) + CHAIN_SUFFIX_MAX)
        except Exception:
            self.drop(DropReason.UNENCODABLE, "unknown")

    def write_later(self, event_type: str, build: Build) -> None:
        """Enqueue one record to be built at the flush, in its place in the queue; never blocks, never raises.

        For the records every request writes: built in a batch they cost a fraction of what
        each costs built alone at a paced load (bench/README.md, issue 34). `build` must
        return the same record whenever it is called (a frozen record's `to_record`).
        """
        if self._closed:
            self.drop(DropReason.WRITER_CLOSED, event_type)
            return
        self._enqueue(event_type, build, _LATER_BYTES + CHAIN_SUFFIX_MAX)

    def _enqueue(self, event_type: str, line: bytes | Build, size: int) -> None:
        """Queue a line (or a record to build) counted at `size` bytes, within the queue's bound."""
        if self.pending_bytes + size > self.max_queue_bytes:
            self.drop(DropReason.QUEUE_FULL, event_type)
            return
        self._queue.append((event_type, line, self._gap))
        self._gap = 0
        self._since_checkpoint += 1
        self._queued_bytes += size
        if len(self._queue) == 1:  # the first since a flush; the task clears it only with the queue empty
            self._arrived.set()
        now = time.monotonic()
        if self._oldest_at is None:
            self._oldest_at = now
        elif now - self._oldest_at >= self.flush_interval_s:
            self._wake.set()  # due: written from this wake-up, not a timer's
        if len(self._queue) >= 1024 or self._queued_bytes * 4 >= self.max_queue_bytes:
            self._wake.set()  # a burst: write now rather than a flush interval on

    @property
    def key_fingerprint(self) -> str | None:
        """The fingerprint of the key that signs this writer's checkpoints (None: unsigned)."""
        return self.signer.public.fingerprint if self.signer is not None else None

    async def flush(self) -> None:
        """Write every record queued so far (and any earlier failed batch) to the file."""
        async with self._flush_lock:
            unwritten, queued = self._unwritten, list(self._queue)
            self._flushing_bytes = self._unwritten_bytes + self._queued_bytes
            self._queue.clear()
            self._oldest_at = None
            self._unwritten, self._queued_bytes, self._unwritten_bytes = [], 0, 0
            fresh = self._built(queued)
            if not unwritten and not fresh:
                return
            try:
                self._unwritten = await asyncio.to_thread(self._chain_and_write, unwritten, fresh)
            finally:
                self._tell_rotations()
                self._unwritten_bytes = sum(len(line) for _, line in self._unwritten)
                self._flushing_bytes = 0
                if self._unwritten:
                    self._arrived.set()  # refused by the disk: retried at the next flush

    def _tell_rotations(self) -> None:
        """Hand what the flush's rotations dropped to `on_rotated` (the thread is done with the file)."""
        for note in self._file.take_dropped():
            if self.on_rotated is not None:
                self.on_rotated(note)

    async def checkpoint_now(self) -> Mark | None:
        """Checkpoint what was queued since the last checkpoint, now; the last line then on disk
        (None while the disk refuses lines, or before the writer's first line)."""
        if self._since_checkpoint:
            self._queue_checkpoint(_PERIODIC)
        await self.flush()
        return self._mark

    def _built(self, queued: list[tuple[str, bytes | Build, int]]) -> list[tuple[str, bytes, int]]:
        """The queued entries as lines: each record queued unbuilt is built and encoded now.

        One that cannot be is dropped and counted, and the next line says it in its
        `dropped_before` (the next queued after this batch, when it was the last).
        """
        lines: list[tuple[str, bytes, int]] = []
        carried = 0  # records dropped here, owed to the next line's dropped_before
        for event_type, entry, gap in queued:
            if isinstance(entry, bytes):
                lines.append((event_type, entry, gap + carried))
                carried = 0
                continue
            try:
                line = encode_record(entry())
                reason = DropReason.RECORD_TOO_LARGE
            except Exception:
                line, reason = None, DropReason.UNENCODABLE
            if line is None:
                self._count_drop(reason, event_type)
                carried += gap + 1
            else:
                lines.append((event_type, line, gap + carried))
                carried = 0
        self._gap += carried
        return lines

    def _queue_checkpoint(self, kind: bytes) -> None:
        """Queue a checkpoint (outside the queue's bound: one small line an interval)."""
        self._queue.append(
            (str(EventType.EVIDENCE_CHECKPOINT), b"\0%b%d" % (kind, time.time_ns()), self._gap)
        )
        self._gap, self._since_checkpoint = 0, 0
        self._checkpoint_at = time.monotonic()

    async def close(self) -> None:
        """Flush everything, with a final checkpoint, fsync, and stop; later writes are dropped and counted."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            # Let the task finish its batch rather than cancel it mid-write.
            self._wake.set()
            self._arrived.set()
            await self._task
            self._task = None
        self._queue_checkpoint(_FINAL)
        await self.flush()
        await asyncio.to_thread(self._file.close)
        for event_type, _ in self._unwritten:  # the disk still refuses: these are lost
            self.drop(DropReason.UNWRITABLE_AT_CLOSE, event_type)
        self._unwritten, self._unwritten_bytes = [], 0

    async def _run(self) -> None:
        """Flush when the oldest record waiting is flush_interval_s old (a record then wakes it), at the
        latest 2 × flush_interval_s after it came (its own timer), sooner on a burst; idle, sleep untimed."""
        while not self._closed:
            await self._wait_for_work()
            self._wake.clear()
            if (
                self._since_checkpoint
                and time.monotonic() - self._checkpoint_at >= self.checkpoint_interval_s
            ):
                self._queue_checkpoint(_PERIODIC)
            try:
                await self.flush()
            except Exception as exc:
                self._flush_errors += 1
                log_event("evidence_flush_failed", error=type(exc).__name__, path=str(self.path))
            async with self._flushed:
                self._periodic_flushes += 1
                self._flushed.notify_all()

    async def _wait_for_work(self) -> None:
        """Return when a flush is due: one flush interval after a record (or a line the disk
        refused) waits, or when the checkpoint the records since the last one are owed falls due.

        With nothing waiting the wait has no timer at all, unless a checkpoint is owed: an idle
        sidecar's writers then cost no wake-up (bench/idle_cpu.py).
        """
        if not self._queue and not self._unwritten:
            owed = self._checkpoint_at + self.checkpoint_interval_s - time.monotonic()
            self._arrived.clear()  # nothing is waiting (checked just now, with no await since)
            if not self._since_checkpoint:
                await self._arrived.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), timeout=max(0.0, owed))
                if not self._queue and not self._unwritten:
                    return  # the checkpoint is due, with no record to wait for
            if self._closed:
                return
        with contextlib.suppress(TimeoutError):  # no record came to say it is due: flush anyway
            await asyncio.wait_for(self._wake.wait(), timeout=2 * self.flush_interval_s)

    async def wait_flushed(self) -> None:
        """Return after the flush task's next flush has finished (for tests and shutdown checks)."""
        self._arrived.set()  # an idle task has no next flush of its own: wake it for one
        async with self._flushed:
            target = self._periodic_flushes + 1
            await self._flushed.wait_for(lambda: self._periodic_flushes >= target or self._task is None)

    def drop(self, kind: DropReason, event_type: str) -> None:
        """Count a record that will never be written (also one refused before it got here), and log the kind once."""
        self._count_drop(kind, event_type)
        if kind is not DropReason.UNWRITABLE_AT_CLOSE:  # those lines were chained already
            self._gap += 1

    def _count_drop(self, kind: DropReason, event_type: str) -> None:
        """Count a dropped record by reason, and log the kind once."""
        self.dropped[kind] += 1
        if kind not in self._logged_drops:
            self._logged_drops.add(kind)
            log_event("evidence_record_dropped", reason=kind, event_type=event_type, path=str(self.path))

    # --- worker thread ------------------------------------------------------------

    def _chain_and_write(
        self, unwritten: list[tuple[str, bytes]], fresh: list[tuple[str, bytes, int]]
    ) -> list[tuple[str, bytes]]:
        """Chain the fresh records after the lines still unwritten, write them all; return what is left."""
        batch = unwritten
        if self._chain is None:
            self._chain = self._open_chain()
            batch.append(
                (str(EventType.EVIDENCE_OPENED), self._chain.opened(version=__version__, file=self.path.name))
            )
        chain = self._chain
        for event_type, line, gap in fresh:
            if line[0] == _MARKER:
                final, at_ns = line[1:2] == _FINAL, int(line[2:])
                batch.append(
                    (
                        str(EventType.EVIDENCE_CHECKPOINT),
                        chain.checkpoint(at_ns=at_ns, final=final, dropped_before=gap),
                    )
                )
            else:
                batch.append((event_type, chain.link(line, event_type, gap)))
        left = self._file.write_batch(batch)
        self._mark = None if left else Mark(chain.seq, chain.head)
        return left

    def _open_chain(self) -> Chain:
        """This writer's chain, continuing the one its files end with (a new one after a corrupt
        or foreign last line, which stays as it is: old files are never rewritten)."""
        predecessor = find_predecessor(evidence_files(self.path, self.keep), self.path)
        if predecessor.broken:
            log_event("evidence_chain_broken_predecessor", path=str(self.path), detail=predecessor.detail)
        return Chain(predecessor, writer_id=secrets.token_hex(8), signer=self.signer)
