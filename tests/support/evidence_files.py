"""A sidecar's evidence as the tests read it from disk: the observation file and the reset records' file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson


def resets_file(evidence: Path) -> Path:
    """The reset records' file beside `evidence` (the default evidence_resets_path)."""
    return evidence.with_name(f"{evidence.stem}.resets{evidence.suffix or '.jsonl'}")


def evidence_records(evidence: Path) -> list[dict[str, Any]]:
    """Every record of both current files (not their rotations), observations first, each in file order."""
    records: list[dict[str, Any]] = []
    for path in (evidence, resets_file(evidence)):
        if path.exists():
            records += [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return records
