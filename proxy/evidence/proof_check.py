"""Checking a Merkle proof answer (`?proof=inclusion`, a bundle's `proofs/<pod>.jsonl`), docs/evidence.md.

Fed the answer's lines in order: each checkpoint's signatures (its line's and its note's, by the
key it names or the pinned one; one key per writer life), each record's audit path to the root its
checkpoint states, and a consistency proof between every two consecutive checkpoints of a writer
life that it holds. A problem names `where:line` in the answer and the record's or checkpoint's seq.
"""

from __future__ import annotations

import base64
import binascii
import itertools
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.evidence.chain import chained_fields
from proxy.evidence.keys import PublicKey
from proxy.evidence.merkle import leaf_hash, verify_consistency, verify_inclusion
from proxy.evidence.signature import Signed, check_checkpoint_signature
from proxy.vocabulary import EventType

__all__ = ["MalformedProof", "ProofCheck", "ProofReport"]

_MAX_PATH = 64  # a tree of 2^64 leaves has shorter paths


class MalformedProof(Exception):
    """An answer that is not one: a line that is no JSON object, sizes that are not its checkpoint's
    or not numbers, hashes that are not 32-byte hex: bad input, refused whole (the message names
    `where:line`). A proof well formed that does not hold is a problem, not this."""


@dataclass(frozen=True)
class ProofReport:
    """What one pod's proof check found (the attributes a chain's report has too)."""

    name: str
    records: int
    checkpoints: int
    signed: int
    keys: tuple[str, ...]
    consistency: int
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def whole(self) -> bool:
        """Every record proven in a signed checkpoint, every two checkpoints consistent."""
        return not self.problems

    def summary_line(self) -> str:
        """One line: verdict, records, checkpoints, keys, consistency proofs."""
        signed = f"{self.signed} signed by {', '.join(self.keys)}" if self.signed else "0 signed"
        signed += f", {self.checkpoints - self.signed} unsigned"
        verdict = "proven" if self.whole else "BROKEN"
        tail = f", {len(self.problems)} problems" if self.problems else ""
        return (
            f"{self.name}: {verdict}: {self.records} records by audit path, {self.checkpoints} checkpoints "
            f"({signed}), {self.consistency} consistency proofs{tail}"
        )


@dataclass(frozen=True)
class _Held:
    """A checkpoint the answer holds, its signatures checked."""

    file: str
    writer_id: str
    seq: int
    tree_size: int
    root: bytes
    line: bytes


def _hashes(value: object) -> list[bytes] | None:
    """A list of hex SHA-256 hashes, decoded; None when it is not one."""
    if not isinstance(value, list) or len(value) > _MAX_PATH:
        return None
    try:
        out = [bytes.fromhex(h) for h in value if isinstance(h, str)]
    except ValueError:
        return None
    return out if len(out) == len(value) and all(len(h) == 32 for h in out) else None


@dataclass
class ProofCheck:
    """Feed one pod's answer line by line (`where` names it), then `finish()`."""

    name: str
    pinned: PublicKey | None = None
    lines: list[bytes] = field(default_factory=list)  # the records proven, exactly as written
    _held: dict[tuple[str, int], _Held] = field(default_factory=dict)
    _writer_keys: dict[str, str] = field(default_factory=dict)
    _keys: dict[str, None] = field(default_factory=dict)
    _linked: set[tuple[str, int, int]] = field(default_factory=set)
    _records: int = 0
    _signed: int = 0
    _problems: list[str] = field(default_factory=list)

    def feed(self, line: bytes, number: int) -> None:
        """Check one line of the answer."""
        where = f"{self.name}:{number}"
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            entry = None
        if not isinstance(entry, dict):
            raise MalformedProof(f"{where}: not a JSON object")
        kind = entry.get("event_type")
        if kind == EventType.PROOF_CHECKPOINT:
            self._checkpoint(entry, where)
        elif kind == EventType.PROOF_INCLUSION:
            self._inclusion(entry, where)
        elif kind == EventType.PROOF_CONSISTENCY:
            self._consistency(entry, where)

    def _checkpoint(self, entry: dict[str, Any], where: str) -> None:
        raw, file = entry.get("line"), str(entry.get("file"))
        line = raw.encode() if isinstance(raw, str) else b""
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None
        fields = chained_fields(record)
        if (
            not isinstance(record, dict)
            or fields is None
            or record.get("event_type") != EventType.EVIDENCE_CHECKPOINT
        ):
            self._problems.append(f"{where}: its line is not a checkpoint")
            return
        seq = fields[0]
        size, root = record.get("tree_size"), record.get("root")
        if type(size) is not int or not isinstance(root, str):
            self._problems.append(f"{where}: checkpoint seq {seq} of {file} states no tree")
            return
        writer = str(record.get("writer_id"))
        if record.get("signed") is True:
            signed = check_checkpoint_signature(record, line, seq, self.pinned)
            if not isinstance(signed, Signed):
                self._problems.append(f"{where}: {file}: {signed}")
                return
            if self._writer_keys.setdefault(writer, signed.key.fingerprint) != signed.key.fingerprint:
                self._problems.append(
                    f"{where}: {file}: checkpoint seq {seq}: the key changed within writer {writer}'s life"
                )
                return
            self._signed += 1
            self._keys[signed.key.fingerprint] = None
        elif self.pinned is not None:
            self._problems.append(
                f"{where}: {file}: checkpoint seq {seq} is unsigned, but a public key was given"
            )
            return
        try:
            digest = base64.b64decode(root, validate=True)
        except (binascii.Error, ValueError):
            digest = b""
        self._held[(file, seq)] = _Held(file, writer, seq, size, digest, line)

    def _inclusion(self, entry: dict[str, Any], where: str) -> None:
        raw, file = entry.get("line"), str(entry.get("file"))
        line = raw.encode() if isinstance(raw, str) else b""
        self._records += 1
        self.lines.append(line)
        try:
            fields = chained_fields(orjson.loads(line))
        except orjson.JSONDecodeError:
            fields = None
        what = f"{file} seq {fields[0]}" if fields else f"{file} leaf {entry.get('leaf_index')}"
        if entry.get("unprovable"):
            self._problems.append(f"{where}: {what} cannot be proven: {entry['unprovable']}")
            return
        held = self._held.get((file, entry.get("checkpoint_seq")))  # type: ignore[arg-type]  # any JSON value: a miss
        path = _hashes(entry.get("audit_path"))
        index = entry.get("leaf_index")
        if held is None:
            self._problems.append(
                f"{where}: {what}: its checkpoint seq {entry.get('checkpoint_seq')} is not held (signed)"
            )
        elif path is None or type(index) is not int or entry.get("tree_size") != held.tree_size:
            raise MalformedProof(
                f"{where}: {what}: a malformed proof: leaf_index {entry.get('leaf_index')!r}, tree_size "
                f"{entry.get('tree_size')!r} (its checkpoint's is {held.tree_size}), audit_path of "
                f"{'hex SHA-256 hashes' if path is not None else 'something else than at most 64 hex SHA-256 hashes'}"
            )
        elif not verify_inclusion(leaf_hash(line), index, held.tree_size, path, held.root):
            self._problems.append(
                f"{where}: {what}: its audit path does not lead to the root of checkpoint seq {held.seq} "
                "(the record, or the proof, was changed)"
            )

    def _consistency(self, entry: dict[str, Any], where: str) -> None:
        file = str(entry.get("file"))
        first = self._held.get((file, entry.get("from_seq")))  # type: ignore[arg-type]  # any JSON value: a miss
        second = self._held.get((file, entry.get("to_seq")))  # type: ignore[arg-type]
        proof = _hashes(entry.get("proof"))
        if proof is None:
            raise MalformedProof(
                f"{where}: {file}: a malformed consistency proof: not at most 64 hex SHA-256 hashes"
            )
        if first is None or second is None:
            self._problems.append(
                f"{where}: {file}: a consistency proof between checkpoints not held (signed)"
            )
            return
        if (entry.get("from_size"), entry.get("to_size")) != (first.tree_size, second.tree_size):
            raise MalformedProof(
                f"{where}: {file}: a malformed consistency proof {first.seq}->{second.seq}: sizes "
                f"{entry.get('from_size')!r}->{entry.get('to_size')!r}, the checkpoints' are "
                f"{first.tree_size}->{second.tree_size}"
            )
        if first.writer_id != second.writer_id or not verify_consistency(
            first.tree_size, second.tree_size, first.root, second.root, proof
        ):
            self._problems.append(
                f"{where}: {file}: checkpoints seq {first.seq} and {second.seq} are not consistent: "
                "not one append-only log (a fork, or a rewritten history)"
            )
            return
        self._linked.add((file, first.seq, second.seq))

    def finish(self) -> ProofReport:
        """The report: also every two consecutive checkpoints of a writer life must be linked."""
        problems = list(self._problems)
        by_life: dict[tuple[str, str], list[_Held]] = {}
        for held in self._held.values():
            by_life.setdefault((held.file, held.writer_id), []).append(held)
        for (file, _writer), life in sorted(by_life.items()):
            ordered = sorted(life, key=lambda h: h.seq)
            for first, second in itertools.pairwise(ordered):
                if (file, first.seq, second.seq) not in self._linked:
                    problems.append(
                        f"{self.name}: {file}: no consistency proof links checkpoints seq {first.seq} and {second.seq}"
                    )
        return ProofReport(
            name=self.name,
            records=self._records,
            checkpoints=len(self._held),
            signed=self._signed,
            keys=tuple(self._keys),
            consistency=len(self._linked),
            problems=tuple(problems),
        )
