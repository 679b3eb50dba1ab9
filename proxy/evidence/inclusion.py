"""`?proof=inclusion` and `?proof=consistency`: Merkle proofs over the evidence files (docs/evidence.md).

Each writer life's lines are the leaves of an RFC 6962 tree (proxy/evidence/merkle.py); every
checkpoint states the tree of the lines of its life before it. One pass over a chain's files
(oldest first, up to the checkpoint the proof asked the writer for) hashes every line as a
leaf of its life and keeps the matching records and the checkpoints. Then each matching record
gets its leaf index and audit path to the first checkpoint of its life after it, and the
checkpoints used (and the life's last) are linked by consistency proofs, each to the next.

The answer is JSON lines, each raw evidence line carried as a JSON string (`line`, its exact
bytes once UTF-8 encoded: every line is UTF-8, as it parsed as JSON):
`cachewitness.proof_chain` (the file), `cachewitness.checkpoint`, `cachewitness.inclusion`,
`cachewitness.consistency`, then the `cachewitness.proof_read` trailer. Hashes are in hex.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from proxy.evidence.chain import Mark, chained_fields, line_hash
from proxy.evidence.merkle import Levels, leaf_hash
from proxy.vocabulary import EventType

__all__ = ["ConsistencyError", "Life", "consistency_answer", "inclusion_lines", "scan_lives"]

_READ_BYTES = 256 * 1024
_ROTATED_AWAY = "its writer life began in a file rotated away: no tree to prove it in"
_NO_CHECKPOINT = "no checkpoint of its writer life follows it"


class ConsistencyError(Exception):
    """A consistency proof that cannot be given: the message says why (a 400)."""


@dataclass
class Life:
    """One writer life's lines in a chain: their leaf hashes, its checkpoints, the matching records."""

    writer_id: str | None
    whole: bool  # its opening line is among the files read: its tree can be rebuilt
    leaves: list[bytes] = field(default_factory=list)
    checkpoints: list[tuple[int, int, bytes]] = field(default_factory=list)  # (tree_size, seq, line)
    matches: list[tuple[int, bytes]] = field(default_factory=list)  # (leaf index, line)


def _lines(handles: Sequence[IO[bytes]]) -> Iterator[bytes]:
    """The whole lines of the files, oldest first, read in chunks."""
    for handle in handles:
        carry = b""
        while chunk := handle.read(_READ_BYTES):
            data = carry + chunk
            start = 0
            while (newline := data.find(b"\n", start)) != -1:
                yield data[start : newline + 1]
                start = newline + 1
            carry = data[start:]


def open_chain(files: Sequence[Path]) -> list[IO[bytes]]:
    """The chain's files, opened now (oldest first): a rotation while they are read renames them,
    it does not move what a handle reads. One rotated away since it was listed is left out."""
    handles: list[IO[bytes]] = []
    for path in files:
        try:
            handles.append(open(path, "rb"))  # noqa: SIM115 -- the caller closes them
        except OSError:
            continue
    return handles


def scan_lives(
    files: Sequence[Path], stop: Mark | None, matches: Callable[[dict[str, Any]], bool]
) -> list[Life]:
    """One pass over a chain's files (opened first, closed after): each writer life's leaves,
    checkpoints and matching records."""
    handles = open_chain(files)
    try:
        return _scan(handles, stop, matches)
    finally:
        for handle in handles:
            handle.close()


def _scan(
    handles: Sequence[IO[bytes]], stop: Mark | None, matches: Callable[[dict[str, Any]], bool]
) -> list[Life]:
    lives: list[Life] = []
    for line in _lines(handles):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            record = {}
        event = record.get("event_type")
        if event == EventType.EVIDENCE_OPENED:
            lives.append(Life(str(record.get("writer_id")), whole=True))
        elif not lives:
            lives.append(Life(None, whole=False))
        life = lives[-1]
        if event == EventType.EVIDENCE_CHECKPOINT:
            fields = chained_fields(record)
            life.writer_id = life.writer_id or str(record.get("writer_id"))
            if "root" in record and fields is not None:  # an older checkpoint states no tree
                life.checkpoints.append((len(life.leaves), fields[0], line))
        elif matches(record):
            life.matches.append((len(life.leaves), line))
        life.leaves.append(leaf_hash(line))
        if stop is not None and event == EventType.EVIDENCE_CHECKPOINT and _is_mark(record, line, stop):
            break
    return lives


def _is_mark(record: dict[str, Any], line: bytes, stop: Mark) -> bool:
    fields = chained_fields(record)
    return fields is not None and fields[0] == stop.seq and line_hash(line) == stop.head


def _dump(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


def _checkpoint_line(file: str, life: Life, checkpoint: tuple[int, int, bytes]) -> bytes:
    size, seq, line = checkpoint
    return _dump(
        {
            "event_type": EventType.PROOF_CHECKPOINT,
            "file": file,
            "writer_id": life.writer_id,
            "seq": seq,
            "tree_size": size,
            "line": line.decode(),
        }
    )


def _life_lines(file: str, life: Life) -> tuple[list[bytes], int]:
    """A life's part of the answer (checkpoints, inclusions, consistency proofs); records unprovable."""
    usable = [c for c in life.checkpoints if 0 < c[0] <= len(life.leaves)]
    if not life.whole or not usable:
        why = _ROTATED_AWAY if not life.whole else _NO_CHECKPOINT
        return [_inclusion(file, life, index, line, None, [], why) for index, line in life.matches], len(
            life.matches
        )
    levels = Levels(life.leaves)
    used: dict[int, tuple[int, int, bytes]] = {}
    inclusions: list[bytes] = []
    unprovable = 0
    for index, line in life.matches:
        after = next((c for c in usable if c[0] > index), None)
        if after is None:
            inclusions.append(_inclusion(file, life, index, line, None, [], _NO_CHECKPOINT))
            unprovable += 1
            continue
        used[after[1]] = after
        inclusions.append(_inclusion(file, life, index, line, after, levels.inclusion(index, after[0]), None))
    if used:
        used[usable[-1][1]] = usable[-1]  # the life's last: the newest root its records are under
    chosen = sorted(used.values(), key=lambda c: c[1])
    out = [_checkpoint_line(file, life, c) for c in chosen]
    out += inclusions
    for first, second in itertools.pairwise(chosen):
        out.append(_consistency(file, life, first, second, levels))
    return out, unprovable


def _inclusion(
    file: str,
    life: Life,
    index: int,
    line: bytes,
    checkpoint: tuple[int, int, bytes] | None,
    path: list[bytes],
    why: str | None,
) -> bytes:
    record: dict[str, Any] = {
        "event_type": EventType.PROOF_INCLUSION,
        "file": file,
        "writer_id": life.writer_id,
        "leaf_index": index,
        "tree_size": checkpoint[0] if checkpoint else None,
        "checkpoint_seq": checkpoint[1] if checkpoint else None,
        "audit_path": [h.hex() for h in path] if checkpoint else None,
        "line": line.decode(),
    }
    if why:
        record["unprovable"] = why
    return _dump(record)


def _consistency(
    file: str, life: Life, first: tuple[int, int, bytes], second: tuple[int, int, bytes], levels: Levels
) -> bytes:
    proof = levels.consistency(first[0], second[0])
    return _dump(
        {
            "event_type": EventType.PROOF_CONSISTENCY,
            "file": file,
            "writer_id": life.writer_id,
            "from_seq": first[1],
            "to_seq": second[1],
            "from_size": first[0],
            "to_size": second[0],
            "proof": [h.hex() for h in proof],
        }
    )


def inclusion_lines(file: str, lives: Sequence[Life]) -> tuple[list[bytes], dict[str, Any]]:
    """One chain's part of `?proof=inclusion`, and its entry in the trailer."""
    out = [_dump({"event_type": EventType.PROOF_CHAIN, "file": file, "proof": "inclusion"})]
    records = unprovable = 0
    for life in lives:
        if not life.matches:
            continue
        lines, missing = _life_lines(file, life)
        out += lines
        records += len(life.matches)
        unprovable += missing
    checkpoints = sum(1 for line in out if line.startswith(b'{"event_type":"cachewitness.checkpoint"'))
    return out, {"file": file, "records": records, "checkpoints": checkpoints, "unprovable": unprovable}


def consistency_answer(file: str, lives: Sequence[Life], first_seq: int, second_seq: int) -> dict[str, Any]:
    """`?proof=consistency&from=S1&to=S2`: the proof between two checkpoints of one writer life."""
    found = {c[1]: (life, c) for life in lives for c in life.checkpoints if c[1] in (first_seq, second_seq)}
    for name, seq in (("from", first_seq), ("to", second_seq)):
        if seq not in found:
            raise ConsistencyError(f"{name}={seq} is not the seq of a checkpoint in {file}")
    (life, first), (other, second) = found[first_seq], found[second_seq]
    if life is not other:
        raise ConsistencyError(
            f"checkpoints {first_seq} and {second_seq} are of two writer lives: each life is its own tree"
        )
    if first_seq > second_seq:
        raise ConsistencyError(f"from={first_seq} comes after to={second_seq}")
    if not life.whole or not 0 < first[0] <= second[0] <= len(life.leaves):
        raise ConsistencyError(f"the tree of writer {life.writer_id} cannot be rebuilt: {_ROTATED_AWAY}")
    proof = Levels(life.leaves[: second[0]]).consistency(first[0], second[0])

    def state(checkpoint: tuple[int, int, bytes]) -> dict[str, Any]:
        return {"seq": checkpoint[1], "tree_size": checkpoint[0], "line": checkpoint[2].decode()}

    return {
        "event_type": EventType.PROOF_CONSISTENCY,
        "file": file,
        "writer_id": life.writer_id,
        "from": state(first),
        "to": state(second),
        "proof": [h.hex() for h in proof],
    }
