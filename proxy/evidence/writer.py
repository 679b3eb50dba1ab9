"""The evidence writer: async, batched JSONL with size rotation, one file and its rotations (the
two files the sidecar keeps are in proxy/evidence/log.py; reading them is proxy/evidence/reader.py)."""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import secrets
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

import orjson

from proxy import __version__
from proxy.evidence.chain import (
    Chain,
    Mark,
    find_predecessor,
)
from proxy.evidence.keys import SigningKey
from proxy.evidence.lines import CHAIN_SUFFIX_MAX, encode_record
from proxy.evidence.reader import evidence_files, rotated
from proxy.vocabulary import EventType

__all__ = ["DropReason", "EvidenceWriter"]

log = logging.getLogger("cachewitness.evidence")


def _log(event: str, **fields: Any) -> None:
    """One structured (JSON) log line."""
    log.warning(orjson.dumps({"event": event, **fields}).decode())


class DropReason(StrEnum):
    """Why an evidence record will never be written (`evidence_dropped_total{reason}`)."""

    QUEUE_FULL = "queue_full"  # the disk refuses and the queue holds its bytes bound
    RECORD_TOO_LARGE = "record_too_large"
    UNENCODABLE = "unencodable"
    WRITER_CLOSED = "writer_closed"
    UNWRITABLE_AT_CLOSE = "unwritable_at_close"  # still refused by the disk at shutdown
    RATE = "rate"  # a refused request's record past evidence_rejected_per_s (proxy/evidence/log.py)


# One os.write carries at most this much: a long backlog (a disk that was full) is written in
# pieces, never joined into one copy of itself.
_WRITE_BYTES = 1024 * 1024
_IOV_MAX = 1024  # buffers per writev (Linux's IOV_MAX)
# Queued in place of a line: a checkpoint, built and signed by the writer's thread. A record's
# line starts with "{"; a marker with NUL, then P (periodic) or F (final), then its at_ns, taken
# when it is queued so that the file stays in at_ns order as far as the records do.
_MARKER = 0
_PERIODIC, _FINAL = b"P", b"F"


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
        flush_interval_s: float = 0.2,
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
        self.records_total: dict[str, int] = {}
        self.write_errors_total = 0
        self.dropped: dict[DropReason, int] = dict.fromkeys(DropReason, 0)
        # (event type, encoded record or a checkpoint marker, records dropped just before it)
        self._queue: collections.deque[tuple[str, bytes, int]] = collections.deque()
        self._unwritten: list[tuple[str, bytes]] = []  # what the disk refused, retried first
        # Bytes of the lines waiting: queued, being written by the thread, refused by the disk.
        self._queued_bytes = 0
        self._flushing_bytes = 0
        self._unwritten_bytes = 0
        self._flush_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._periodic_flushes = 0
        self._flushed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._fd: int | None = None
        self._size = 0
        self._logged_errors: set[str] = set()  # touched by the worker thread only
        self._logged_drops: set[str] = set()  # touched by the event loop only
        self._gap = 0  # records dropped since the last one queued (event loop)
        self._since_checkpoint = 0  # records queued since the last checkpoint (event loop)
        self._checkpoint_at = time.monotonic()
        self._chain: Chain | None = None  # the writer's thread's, from its first batch on
        self._mark: Mark | None = None  # the last line written, while nothing chained waits

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
            size = len(line) + CHAIN_SUFFIX_MAX
            if self.pending_bytes + size > self.max_queue_bytes:
                self.drop(DropReason.QUEUE_FULL, event_type)
                return
            self._queue.append((event_type, line, self._gap))
            self._gap = 0
            self._since_checkpoint += 1
            self._queued_bytes += size
            if len(self._queue) >= 1024:
                self._wake.set()  # a burst: write now rather than at the next tick
        except Exception:
            self.drop(DropReason.UNENCODABLE, "unknown")

    @property
    def key_fingerprint(self) -> str | None:
        """The fingerprint of the key that signs this writer's checkpoints (None: unsigned)."""
        return self.signer.public.fingerprint if self.signer is not None else None

    async def flush(self) -> None:
        """Write every record queued so far (and any earlier failed batch) to the file."""
        async with self._flush_lock:
            unwritten, fresh = self._unwritten, list(self._queue)
            self._flushing_bytes = self._unwritten_bytes + self._queued_bytes
            self._queue.clear()
            self._unwritten, self._queued_bytes, self._unwritten_bytes = [], 0, 0
            if not unwritten and not fresh:
                return
            try:
                self._unwritten = await asyncio.to_thread(self._chain_and_write, unwritten, fresh)
            finally:
                self._unwritten_bytes = sum(len(line) for _, line in self._unwritten)
                self._flushing_bytes = 0

    async def checkpoint_now(self) -> Mark | None:
        """Checkpoint what was queued since the last checkpoint, now; the last line then on disk
        (None while the disk refuses lines, or before the writer's first line)."""
        if self._since_checkpoint:
            self._queue_checkpoint(_PERIODIC)
        await self.flush()
        return self._mark

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
            await self._task
            self._task = None
        self._queue_checkpoint(_FINAL)
        await self.flush()
        await asyncio.to_thread(self._close_file)
        for event_type, _ in self._unwritten:  # the disk still refuses: these are lost
            self.drop(DropReason.UNWRITABLE_AT_CLOSE, event_type)
        self._unwritten, self._unwritten_bytes = [], 0

    async def _run(self) -> None:
        """Flush every flush_interval_s (sooner on a burst)."""
        while not self._closed:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.flush_interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            if (
                self._since_checkpoint
                and time.monotonic() - self._checkpoint_at >= self.checkpoint_interval_s
            ):
                self._queue_checkpoint(_PERIODIC)
            try:
                await self.flush()
            except Exception as exc:
                self.write_errors_total += 1
                _log("evidence_flush_failed", error=type(exc).__name__, path=str(self.path))
            async with self._flushed:
                self._periodic_flushes += 1
                self._flushed.notify_all()

    async def wait_flushed(self) -> None:
        """Return after the flush task's next flush has finished (for tests and shutdown checks)."""
        async with self._flushed:
            target = self._periodic_flushes + 1
            await self._flushed.wait_for(lambda: self._periodic_flushes >= target or self._task is None)

    def drop(self, kind: DropReason, event_type: str) -> None:
        """Count a record that will never be written (also one refused before it got here), and log the kind once."""
        self.dropped[kind] += 1
        if kind is not DropReason.UNWRITABLE_AT_CLOSE:  # those lines were chained already
            self._gap += 1
        if kind not in self._logged_drops:
            self._logged_drops.add(kind)
            _log("evidence_record_dropped", reason=kind, event_type=event_type, path=str(self.path))

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
        left = self._write_batch(batch)
        self._mark = None if left else Mark(chain.seq, chain.head)
        return left

    def _open_chain(self) -> Chain:
        """This writer's chain, continuing the one its files end with (a new one after a corrupt
        or foreign last line, which stays as it is: old files are never rewritten)."""
        predecessor = find_predecessor(evidence_files(self.path, self.keep), self.path)
        if predecessor.broken:
            _log("evidence_chain_broken_predecessor", path=str(self.path), detail=predecessor.detail)
        return Chain(predecessor, writer_id=secrets.token_hex(8), signer=self.signer)

    def _write_batch(self, batch: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """Append a batch, rotating by size; return what could not be written."""
        written = 0
        try:
            while written < len(batch):
                fd = self._open()
                if self._size > 0 and self._size + len(batch[written][1]) > self.max_bytes:
                    self._rotate()
                    fd = self._open()
                # The lines that fit in the current file go down in one write of at most
                # _WRITE_BYTES (a syscall per record costs more than the record): at least one.
                end, size = written + 1, len(batch[written][1])
                while (
                    end < len(batch)
                    and self._size + size + len(batch[end][1]) <= self.max_bytes
                    and size + len(batch[end][1]) <= _WRITE_BYTES
                ):
                    size += len(batch[end][1])
                    end += 1
                chunk = batch[written:end]
                whole, error = self._write_lines(fd, [line for _, line in chunk])
                for event_type, _ in chunk[:whole]:
                    self.records_total[event_type] = self.records_total.get(event_type, 0) + 1
                written += whole
                if error is not None:
                    raise error
        except OSError as exc:
            self.write_errors_total += 1
            kind = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
            if kind not in self._logged_errors:
                self._logged_errors.add(kind)
                _log("evidence_write_failed", error=kind, detail=str(exc), path=str(self.path))
            self._close_file(sync=False)  # reopen next time: the path may have been fixed
        else:
            if self._logged_errors:
                _log("evidence_write_recovered", path=str(self.path))
                self._logged_errors.clear()
        finally:
            self._copy_to_stdout(batch[:written] if written < len(batch) else batch)
        return batch[written:]

    def _write_lines(self, fd: int, lines: list[bytes]) -> tuple[int, OSError | None]:
        """Write the lines (writev: no joined copy) as far as the disk takes them: how many went
        down whole, and the error that stopped the rest (a line cut part-way is truncated off)."""
        start, done = self._size, 0
        index, offset = 0, 0  # the first line not yet written whole, and how much of it is
        try:
            while index < len(lines):
                views: list[bytes | memoryview] = [memoryview(lines[index])[offset:]]
                views += lines[index + 1 : index + _IOV_MAX]
                written = os.writev(fd, views)
                done += written
                while index < len(lines) and written >= len(lines[index]) - offset:
                    written -= len(lines[index]) - offset
                    index, offset = index + 1, 0
                offset += written
        except OSError as exc:
            try:
                os.ftruncate(fd, start + done - offset)
            except OSError:
                pass
            self._size = start + done - offset
            return index, exc
        self._size = start + done
        return len(lines), None

    def _open(self) -> int:
        """The current file's descriptor, opening (and creating its directory) when needed."""
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._size = os.fstat(fd).st_size
            self._fd = fd
        return self._fd

    def _rotate(self) -> None:
        """fsync and close the current file, shift `.1`…`.N`, drop what falls off."""
        self._close_file()
        if self.keep <= 0:
            self.path.unlink(missing_ok=True)
            return
        oldest = rotated(self.path, self.keep)
        oldest.unlink(missing_ok=True)
        for index in range(self.keep - 1, 0, -1):
            source = rotated(self.path, index)
            if source.exists():
                source.replace(rotated(self.path, index + 1))
        self.path.replace(rotated(self.path, 1))

    def _close_file(self, sync: bool = True) -> None:
        """fsync (when asked) and close the current file, if open."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if sync:
                os.fsync(fd)
        except OSError as exc:
            self.write_errors_total += 1
            _log(
                "evidence_fsync_failed",
                error=errno.errorcode.get(exc.errno or 0, "OSError"),
                path=str(self.path),
            )
        finally:
            os.close(fd)

    def _copy_to_stdout(self, batch: list[tuple[str, bytes]]) -> None:
        """Copy lines to stdout for log shippers, when configured."""
        if not self.stdout or not batch:
            return
        data = b"".join(line for _, line in batch)
        try:
            buffer = getattr(sys.stdout, "buffer", None)
            if buffer is not None:
                buffer.write(data)
            else:
                sys.stdout.write(data.decode())
            sys.stdout.flush()
        except (OSError, ValueError):
            pass  # stdout gone (closed pipe): the file is the evidence of record
