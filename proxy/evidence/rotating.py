"""One evidence file and its size rotations, as the writer's thread appends to them: batched
writes (writev, a line never split), rotation by size, fsync, a copy to stdout. The queue, the
chain and the checkpoints in front of it are proxy/evidence/writer.py's."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from proxy.evidence.reader import rotated

__all__ = ["RotatingFile", "describe_dropped", "log_event"]

log = logging.getLogger("cachewitness.evidence")

# One os.write carries at most this much: a long backlog (a disk that was full) is written in
# pieces, never joined into one copy of itself.
_WRITE_BYTES = 1024 * 1024
_IOV_MAX = 1024  # buffers per writev (Linux's IOV_MAX)
# How much of a dropped file's start and end is read for its first and last line's seq and at_ns.
_EDGE_BYTES = 64 * 1024


def log_event(event: str, **fields: Any) -> None:
    """One structured (JSON) log line of the evidence writer's."""
    log.warning(orjson.dumps({"event": event, **fields}).decode())


class RotatingFile:
    """`path` and its rotations `.1`…`.keep`: appends whole lines, rotating past `max_bytes`.

    Used from one thread at a time (the writer's). A disk error is counted and logged once
    per kind until a batch goes down whole again; the file is then reopened, since its path
    may have been fixed meanwhile.
    """

    def __init__(self, path: Path, *, max_bytes: int, keep: int, stdout: bool) -> None:
        """Configure; nothing is opened until the first batch."""
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.stdout = stdout
        self.records_total: dict[str, int] = {}  # lines written whole, by event type
        self.write_errors_total = 0
        self._fd: int | None = None
        self._size = 0
        self._logged_errors: set[str] = set()
        # What each rotation dropped, until the writer takes it (`take_dropped`) to record it.
        self._dropped: list[dict[str, Any]] = []

    def take_dropped(self) -> list[dict[str, Any]]:
        """The files rotations dropped since the last call (`describe_dropped` of each)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def write_batch(self, batch: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """Append a batch of (event type, line), rotating by size; return what could not be written."""
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
                log_event("evidence_write_failed", error=kind, detail=str(exc), path=str(self.path))
            self.close(sync=False)  # reopen next time: the path may have been fixed
        else:
            if self._logged_errors:
                log_event("evidence_write_recovered", path=str(self.path))
                self._logged_errors.clear()
        finally:
            self._copy_to_stdout(batch[:written] if written < len(batch) else batch)
        return batch[written:]

    def close(self, sync: bool = True) -> None:
        """fsync (when asked) and close the current file, if open."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if sync:
                os.fsync(fd)
        except OSError as exc:
            self.write_errors_total += 1
            log_event(
                "evidence_fsync_failed",
                error=errno.errorcode.get(exc.errno or 0, "OSError"),
                path=str(self.path),
            )
        finally:
            os.close(fd)

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
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start + done - offset)
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
        self.close()
        oldest = self.path if self.keep <= 0 else rotated(self.path, self.keep)
        if oldest.exists():
            # History about to go: said in the resets file (proxy/evidence/log.py), never silently.
            self._dropped.append(describe_dropped(oldest))
        oldest.unlink(missing_ok=True)
        if self.keep <= 0:
            return
        for index in range(self.keep - 1, 0, -1):
            source = rotated(self.path, index)
            if source.exists():
                source.replace(rotated(self.path, index + 1))
        self.path.replace(rotated(self.path, 1))

    def _copy_to_stdout(self, batch: list[tuple[str, bytes]]) -> None:
        """Copy lines to stdout for log shippers, when configured."""
        if not self.stdout or not batch:
            return
        data = b"".join(line for _, line in batch)
        # stdout gone (a closed pipe): the file is the evidence of record.
        with contextlib.suppress(OSError, ValueError):
            buffer = getattr(sys.stdout, "buffer", None)
            if buffer is not None:
                buffer.write(data)
            else:
                sys.stdout.write(data.decode())
            sys.stdout.flush()


def _seq_and_at(line: bytes) -> tuple[int | None, int | None]:
    """A line's chain `seq` and its `at_ns` (None each where the line has none)."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(record, dict):
        return None, None
    seq, at_ns = record.get("seq"), record.get("at_ns")
    return (seq if type(seq) is int else None), (at_ns if type(at_ns) is int else None)


def describe_dropped(path: Path) -> dict[str, Any]:
    """What a file about to be dropped holds: its name, size, and the seq and at_ns of its first
    and last whole lines (read from its first and last 64 KiB: a line longer is None)."""
    note: dict[str, Any] = {"dropped_file": path.name, "dropped_bytes": 0}
    try:
        with path.open("rb") as file:
            size = os.fstat(file.fileno()).st_size
            head = file.read(_EDGE_BYTES)
            file.seek(max(0, size - _EDGE_BYTES))
            tail = file.read(_EDGE_BYTES)
    except OSError:
        return note
    first = head.split(b"\n", 1)[0]
    last = tail.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    first_seq, first_at = _seq_and_at(first)
    last_seq, last_at = _seq_and_at(last)
    note.update(
        dropped_bytes=size,
        first_seq=first_seq,
        last_seq=last_seq,
        first_at_ns=first_at,
        last_at_ns=last_at,
    )
    return note
