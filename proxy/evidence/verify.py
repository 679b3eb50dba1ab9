"""Checking a chain of evidence lines: every link, seq, count and signature (docs/evidence.md).

`ChainCheck` takes one writer's lines in order (one file and its rotations, or a segment of
them) and says what is wrong with them, naming `file:line`. Lines before the first one it
sees are no fault (rotated away, or outside a bundle's segment); anything edited, deleted,
inserted or reordered among them is, and so are records after the last checkpoint (no
signature covers them) and a chain that restarts because its writer found a corrupt line.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import orjson

from proxy.evidence.chain import ZERO_HASH, chained_fields, line_hash
from proxy.evidence.keys import PublicKey
from proxy.evidence.merkle import CompactTree, leaf_hash
from proxy.evidence.signature import Signed, check_checkpoint_signature
from proxy.vocabulary import EventType

__all__ = ["ChainCheck", "ChainReport"]


def _records(n: int) -> str:
    return f"{n} record" if n == 1 else f"{n} records"


@dataclass(frozen=True)
class ChainReport:
    """What one chain's check found."""

    name: str
    files: tuple[str, ...]
    records: int
    first_seq: int | None
    last_seq: int | None
    lives: int
    checkpoints: int
    signed: int
    unsigned: int
    keys: tuple[str, ...]
    gaps: tuple[tuple[int, int], ...]  # (seq of the line that declares it, records dropped before it)
    closed: bool
    problems: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def whole(self) -> bool:
        """Nothing edited, dropped unannounced, reordered or unproven."""
        return not self.problems

    def summary_line(self) -> str:
        """One line: verdict, records, seqs, lives, checkpoints, keys, gaps, problems."""
        seqs = f"seq {self.first_seq}-{self.last_seq}" if self.first_seq is not None else "no seq"
        signed = f"{self.signed} signed by {', '.join(self.keys)}" if self.signed else "0 signed"
        parts = [
            _records(self.records),
            seqs,
            f"{self.lives} writer {'life' if self.lives == 1 else 'lives'}",
            f"{self.checkpoints} checkpoints ({signed}, {self.unsigned} unsigned)",
            "closed" if self.closed else "open (no final checkpoint)",
        ]
        if self.gaps:
            dropped = sum(n for _, n in self.gaps)
            where = ", ".join(f"{n} before seq {seq}" for seq, n in self.gaps[:5])
            more = f", … {len(self.gaps) - 5} more" if len(self.gaps) > 5 else ""
            parts.append(f"gaps: {dropped} records dropped, declared ({where}{more})")
        if self.problems:
            parts.append(f"{len(self.problems)} problems")
        verdict = "whole" if self.whole else "BROKEN"
        return f"{self.name}: {verdict}: " + ", ".join(parts)


@dataclass
class ChainCheck:
    """Feed one chain's lines in order, then `finish()`."""

    name: str
    pinned: PublicKey | None = None
    records: int = 0
    _files: list[str] = field(default_factory=list)
    _head: str | None = None  # the last line's hash; None before the first line
    _seq: int | None = None  # the last line's seq; None after a line that is not chained
    _file: str = ""
    _first_seq: int | None = None
    _lives: int = 0
    _checkpoints: int = 0
    _signed: int = 0
    _unsigned: int = 0
    _keys: dict[str, None] = field(default_factory=dict)
    _writer_keys: dict[str, str | None] = field(default_factory=dict)
    _counts: dict[str, int] = field(default_factory=dict)
    _counted: bool = False  # whether _counts started at a checkpoint or an opening
    _unproven: int = 0
    _last_checkpoint: int | None = None
    _closed: bool = False
    _gaps: list[tuple[int, int]] = field(default_factory=list)
    _problems: list[str] = field(default_factory=list)
    _notes: list[str] = field(default_factory=list)
    _tree: CompactTree | None = None  # the current life's Merkle tree, when its opening was seen

    def feed(self, line: bytes, file: str, number: int) -> None:
        """Check one line (its exact bytes, newline included) found at `file:number`."""
        where = f"{file}:{number}"
        if file != self._file:
            self._files.append(file)
        digest = line_hash(line)
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None
        fields = chained_fields(record)
        if fields is None or not isinstance(record, dict):
            self._problems.append(f"{where}: not a chained evidence record (a corrupt or foreign line)")
            self._head, self._seq, self._file, self._counted = digest, None, file, False
            return
        if not line.endswith(b"\n"):
            self._problems.append(f"{where}: the last line has no newline (cut mid-write, or truncated)")
        seq, prev = fields
        self._link(record, seq, prev, where, file)
        self._head, self._seq, self._file = digest, seq, file
        self.records += 1
        if self._first_seq is None:
            self._first_seq = seq
        dropped = record.get("dropped_before")
        if type(dropped) is int and dropped > 0:
            self._gaps.append((seq, dropped))
        event = str(record.get("event_type"))
        if event == EventType.EVIDENCE_OPENED:
            self._opened(record, seq, where)
        if event == EventType.EVIDENCE_CHECKPOINT:
            self._checkpoint(record, line, seq, where)
        else:
            self._counts[event] = self._counts.get(event, 0) + 1
            self._unproven += 1
        if self._tree is not None:
            self._tree.append(leaf_hash(line))

    def _link(self, record: dict[str, object], seq: int, prev: str, where: str, file: str) -> None:
        """Whether the line follows the one before it: its prev, and its seq."""
        fresh = record.get("event_type") == EventType.EVIDENCE_OPENED and seq == 1
        if self._head is None:
            if not (seq == 1 and prev == ZERO_HASH):
                self._notes.append(
                    f"{where}: starts at seq {seq}; the lines before it are not in these files"
                )
            return
        last = self._seq
        if prev != self._head:
            if last is None or seq == last + 1:
                self._problems.append(
                    f"{where}: prev is not the hash of the line before it: that line was edited (or this one)"
                )
            elif seq > last + 1:
                missing = f"{_records(seq - last - 1)} missing"
                if file != self._file:
                    self._problems.append(
                        f"{where}: seq {seq} follows seq {last} at the end of {self._file}: {missing} "
                        "between the two files (a rotated file removed?)"
                    )
                else:
                    self._problems.append(f"{where}: seq {seq} follows seq {last}: {missing} (lines deleted)")
            else:
                self._problems.append(
                    f"{where}: seq {seq} follows seq {last}: lines reordered, or one inserted"
                )
        elif last is not None and seq != last + 1 and not fresh:
            self._problems.append(
                f"{where}: seq {seq} follows seq {last} though it links to it: its seq was edited"
            )
        if fresh and not record.get("broken_predecessor"):
            self._problems.append(
                f"{where}: a fresh chain (seq 1) starts after seq {last}: the lines before it are another log's"
            )

    def _opened(self, record: dict[str, object], seq: int, where: str) -> None:
        """A writer's life starts: its counts start here."""
        self._lives += 1
        self._counts, self._counted = {}, True
        self._tree = CompactTree()
        if record.get("broken_predecessor"):
            self._problems.append(
                f"{where}: the chain restarts: its writer found the line before it corrupt or foreign "
                "(broken_predecessor)"
            )
        elif record.get("resumed_from_seq") != seq - 1:
            self._problems.append(
                f"{where}: resumed_from_seq {record.get('resumed_from_seq')} is not the seq before it ({seq - 1})"
            )

    def _checkpoint(self, record: dict[str, object], line: bytes, seq: int, where: str) -> None:
        """Its counts, and its signature when it has one."""
        self._checkpoints += 1
        counts = record.get("counts")
        if self._counted and counts != self._counts:
            self._problems.append(
                f"{where}: checkpoint seq {seq} counts {counts} but the records since the last one are "
                f"{dict(sorted(self._counts.items()))}"
            )
        self._counts, self._counted, self._unproven = {}, True, 0
        self._last_checkpoint, self._closed = seq, record.get("final") is True
        self._tree_root(record, seq, where)
        if record.get("signed") is True:
            self._signature(record, line, seq, where)
            return
        self._unsigned += 1
        if self.pinned is not None:
            self._problems.append(f"{where}: checkpoint seq {seq} is unsigned, but a public key was given")

    def _tree_root(self, record: dict[str, object], seq: int, where: str) -> None:
        """Its tree size and root against the tree of this life's lines (when the life's opening
        is among the lines given); a checkpoint of an older format carries neither."""
        if "root" not in record or self._tree is None:
            return
        root = base64.b64encode(self._tree.root()).decode()
        if (record.get("tree_size"), record.get("root")) != (self._tree.size, root):
            self._problems.append(
                f"{where}: checkpoint seq {seq} states tree size {record.get('tree_size')} root "
                f"{record.get('root')}, but this life's lines before it make {self._tree.size} {root}"
            )

    def _signature(self, record: dict[str, object], line: bytes, seq: int, where: str) -> None:
        """Its signatures (proxy/evidence/signature.py), and the key the same as its life's before."""
        signed = check_checkpoint_signature(record, line, seq, self.pinned)
        if not isinstance(signed, Signed):
            self._problems.append(f"{where}: {signed}")
            return
        key = signed.key
        writer = str(record.get("writer_id"))
        if self._writer_keys.setdefault(writer, key.fingerprint) != key.fingerprint:
            self._problems.append(
                f"{where}: checkpoint seq {seq}: the key changed within writer {writer}'s life"
            )
            return
        self._signed += 1
        self._keys[key.fingerprint] = None

    def finish(self) -> ChainReport:
        """The report (the check may go on being fed afterwards)."""
        problems = list(self._problems)
        if self._unproven and self._last_checkpoint is not None:
            problems.append(
                f"{_records(self._unproven)} after the last checkpoint (seq {self._last_checkpoint}) "
                "cannot be proven: no checkpoint signs them"
            )
        elif self._unproven:
            problems.append(f"{_records(self._unproven)} cannot be proven: no checkpoint among them")
        return ChainReport(
            name=self.name,
            files=tuple(self._files),
            records=self.records,
            first_seq=self._first_seq,
            last_seq=self._seq,
            lives=self._lives,
            checkpoints=self._checkpoints,
            signed=self._signed,
            unsigned=self._unsigned,
            keys=tuple(self._keys),
            gaps=tuple(self._gaps),
            closed=self._closed,
            problems=tuple(problems),
            notes=tuple(self._notes),
        )
