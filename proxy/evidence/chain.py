"""The hash chain every evidence line carries, built by the writer's thread (docs/evidence.md).

Each line ends with `"seq":N,"prev":"<hex>"`: its number in the writer's chain (from 1, kept
across restarts and rotations) and the SHA-256 of the previous line's exact bytes. A writer's
life starts with an `infer.evidence_opened` line; every `checkpoint_interval_s`, and at
shutdown, it appends an `infer.evidence_checkpoint` whose signature covers the chain's head.
Records lost before they were chained are declared by the next line: `dropped_before`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from proxy.evidence.keys import SigningKey
from proxy.evidence.lines import MAX_LINE_BYTES
from proxy.evidence.merkle import CompactTree, leaf_hash
from proxy.evidence.note import signed_note
from proxy.vocabulary import EventType

__all__ = [
    "ZERO_HASH",
    "Chain",
    "Mark",
    "Predecessor",
    "chained_fields",
    "find_predecessor",
    "line_hash",
    "log_origin",
]

ZERO_HASH = "0" * 64
_HEX64 = re.compile(r"[0-9a-f]{64}")
# A last line longer than this is not one the writer wrote (its lines are at most 64 KiB).
_TAIL_BYTES = MAX_LINE_BYTES + 1


def line_hash(line: bytes) -> str:
    """The hex SHA-256 of one line's exact bytes, its newline included."""
    return hashlib.sha256(line).hexdigest()


def chained_fields(record: object) -> tuple[int, str] | None:
    """A parsed line's `(seq, prev)`, None when it carries no valid chain fields."""
    if not isinstance(record, dict):
        return None
    seq, prev = record.get("seq"), record.get("prev")
    if type(seq) is not int or seq < 1 or not isinstance(prev, str) or not _HEX64.fullmatch(prev):
        return None
    return seq, prev


@dataclass(frozen=True)
class Mark:
    """A line of a chain, by its seq and hash (where a proof stops)."""

    seq: int
    head: str


@dataclass(frozen=True)
class Predecessor:
    """What a writer found at the end of its log when it started."""

    seq: int  # the last line's seq; 0 for a fresh log or a broken predecessor
    head: str  # the last line's hash (ZERO_HASH for a fresh log)
    broken: bool  # the last line was corrupt or foreign: a new chain starts
    detail: str = ""


def _last_line(data: bytes) -> bytes | None:
    """The last whole line of a file's tail (ending "\\n"), None when the tail holds none."""
    end = len(data) - 1
    start = data.rfind(b"\n", 0, end) + 1
    if start == 0 and len(data) >= _TAIL_BYTES:
        return None  # no line start within the longest line a writer writes
    return data[start:]


def find_predecessor(files: list[Path], current: Path) -> Predecessor:
    """The chain's end in the newest non-empty file (`files` oldest first).

    A current file cut mid-line (the process died mid-write) gets a newline appended, so the
    cut line stays as it is, and whole, and the new chain links to it. Nothing is rewritten.
    """
    for file in reversed(files):
        try:
            with open(file, "rb") as handle:
                size = handle.seek(0, os.SEEK_END)
                if size == 0:
                    continue
                handle.seek(max(0, size - _TAIL_BYTES))
                data = handle.read()
        except OSError:
            continue
        detail = ""
        if not data.endswith(b"\n"):
            if file == current:
                try:
                    with open(file, "ab") as handle:
                        handle.write(b"\n")
                except OSError:
                    pass  # the disk refuses even this: the next line joins the cut one, which verify names
            data += b"\n"
            detail = "its last line was cut mid-write"
        line = _last_line(data)
        if line is None:
            return Predecessor(
                0, ZERO_HASH, True, f"{file.name}: no line end in its last {_TAIL_BYTES} bytes"
            )
        try:
            fields = chained_fields(orjson.loads(line))
        except orjson.JSONDecodeError:
            fields = None
        if fields is None or detail:
            return Predecessor(
                0, line_hash(line), True, f"{file.name}: {detail or 'its last line is not chained'}"
            )
        return Predecessor(fields[0], line_hash(line), False)
    return Predecessor(0, ZERO_HASH, False)


def log_origin(file: str, writer_id: str) -> str:
    """A writer life's log name, the first line of its checkpoints' notes: `cachewitness/<host>/<file>/<writer_id>`
    (the host is the pod's name under Kubernetes)."""
    host, name = (re.sub(r"[^A-Za-z0-9._-]", "_", part) or "_" for part in (socket.gethostname(), file))
    return f"cachewitness/{host}/{name}/{writer_id}"


def _ordered(counts: dict[str, int]) -> dict[str, int]:
    return dict(sorted(counts.items()))


class Chain:
    """One writer's chain: numbers, links and counts its lines. Used by the writer's thread only."""

    def __init__(self, predecessor: Predecessor, *, writer_id: str, signer: SigningKey | None) -> None:
        """Continue after `predecessor` (a broken one starts over at seq 1)."""
        self.predecessor = predecessor
        self.writer_id = writer_id
        self.signer = signer
        self.seq = predecessor.seq
        self._head = predecessor.head.encode()
        self.counts: dict[str, int] = {}  # since the last checkpoint (or this life's opening)
        # The life's Merkle tree: every line this writer writes is a leaf, its opening first.
        self.tree = CompactTree()
        self.origin = log_origin("", writer_id)

    @property
    def head(self) -> str:
        """The hash of the last line chained."""
        return self._head.decode()

    def link(self, line: bytes, event_type: str, dropped_before: int = 0) -> bytes:
        """`line` (an encoded record ending "}\\n") with its chain fields added."""
        self.seq += 1
        body = line[:-2] if len(line) > 3 else line[:-2] + b'"empty":true'
        gap = b',"dropped_before":%d' % dropped_before if dropped_before else b""
        out = b"".join((body, gap, b',"seq":%d,"prev":"' % self.seq, self._head, b'"}\n'))
        self._head = hashlib.sha256(out).hexdigest().encode()
        self.tree.append(leaf_hash(out))
        self.counts[event_type] = self.counts.get(event_type, 0) + 1
        return out

    def opened(self, *, version: str, file: str) -> bytes:
        """The `infer.evidence_opened` line this writer's life starts with."""
        record: dict[str, Any] = {
            "event_type": EventType.EVIDENCE_OPENED,
            "schema_version": 1,
            "at_ns": time.time_ns(),
            "writer_id": self.writer_id,
            "pid": os.getpid(),
            "version": version,
            "file": file,
            "resumed_from_seq": self.predecessor.seq,
            "broken_predecessor": self.predecessor.broken,
            "key_fingerprint": self.signer.public.fingerprint if self.signer else None,
        }
        self.counts = {}
        self.tree, self.origin = CompactTree(), log_origin(file, self.writer_id)
        return self.link(
            orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE), str(EventType.EVIDENCE_OPENED)
        )

    def checkpoint(self, *, at_ns: int, final: bool, dropped_before: int = 0) -> bytes:
        """An `infer.evidence_checkpoint` line: the counts since the last one, signed with the head."""
        record: dict[str, Any] = {
            "event_type": EventType.EVIDENCE_CHECKPOINT,
            "schema_version": 1,
            "at_ns": at_ns,
            "writer_id": self.writer_id,
            "counts": _ordered(self.counts),
            "final": final,
            "signed": self.signer is not None,
            "key_fingerprint": self.signer.public.fingerprint if self.signer else None,
            "public_key": self.signer.public.text if self.signer else None,
        }
        # The tree of every line of this life before this one (it is the next tree's leaf).
        root = self.tree.root()
        record["tree_size"] = self.tree.size
        record["root"] = base64.b64encode(root).decode()
        record["note"] = signed_note(self.origin, self.tree.size, root, self.signer) if self.signer else None
        if dropped_before:
            record["dropped_before"] = dropped_before
        self.seq += 1
        body = orjson.dumps(record)[:-1] + b',"seq":%d,"prev":"%s"}' % (self.seq, self._head)
        if self.signer is None:
            out = body + b"\n"
        else:
            out = body[:-1] + b',"signature":"%s"}\n' % self.signer.sign(body).encode()
        self._head = hashlib.sha256(out).hexdigest().encode()
        self.tree.append(leaf_hash(out))
        self.counts = {}
        return out
