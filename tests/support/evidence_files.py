"""A sidecar's evidence as the tests read it from disk: the observation file and the reset records' file."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson

from proxy.config import resets_beside

# The writer's own lines (proxy/evidence/chain.py), beside the records it is given.
CHAIN_EVENTS = frozenset({"infer.evidence_opened", "infer.evidence_checkpoint"})


def resets_file(evidence: Path) -> Path:
    """The reset records' file beside `evidence` (the default evidence_resets_path)."""
    return resets_beside(evidence)


def evidence_records(evidence: Path) -> list[dict[str, Any]]:
    """Every record of both current files (not their rotations), observations first, each in file
    order, each file's chain checked (`unchained`)."""
    records: list[dict[str, Any]] = []
    for path in (evidence, resets_file(evidence)):
        if path.exists():
            records += unchained(path.read_bytes())
    return records


def unchained(data: bytes) -> list[dict[str, Any]]:
    """The records of one chained file, each line checked against the one before it (`seq` one
    more, `prev` its SHA-256; a first line of seq 1 links to 64 zeros), with `seq` and `prev`
    taken off and the writer's own lines (CHAIN_EVENTS) left out."""
    records: list[dict[str, Any]] = []
    before: bytes | None = None
    last_seq = 0
    for line in data.splitlines(keepends=True):
        record = orjson.loads(line)
        seq, prev = record.pop("seq"), record.pop("prev")
        if before is not None:
            assert (seq, prev) == (last_seq + 1, hashlib.sha256(before).hexdigest()), line
        elif seq == 1:
            assert prev == "0" * 64, line
        before, last_seq = line, seq
        if record["event_type"] not in CHAIN_EVENTS:
            records.append(record)
    return records
