"""The merged read of the two evidence files (proxy/evidence/log.py) against a plain per-line merge.

`GET /cache/evidence` serves the observation file and the reset records' file as one stream
in `at_ns` order (tests/test_evidence_flood.py checks it through the sidecar). The reader
merges a block (one chunk read) at a time; this checks, on files of several blocks, that the
result is exactly the per-line merge: every line once, each file's order kept, the earlier
file first on a tie, a line without `at_ns` kept after the line before it.
"""

from __future__ import annotations

import asyncio
import heapq
import tempfile
from pathlib import Path

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.evidence.merge import read_merged

# Lines of ~3 KB: a file of 100 spans two 256 KiB chunk reads.
PAD = "p" * 3000

# Each line: how far its at_ns is past the line before it (0: a tie), or None: a line
# without at_ns (a record of another shape, or one that is not JSON).
_steps = st.lists(st.one_of(st.integers(0, 3), st.none()), max_size=220)


def _lines(steps: list[int | None], tag: str) -> tuple[list[bytes], list[int]]:
    """The lines of one file and the merge key each has (at_ns, or the key of the line before)."""
    lines, keys, at_ns = [], [], 0
    for index, step in enumerate(steps):
        if step is None:
            lines.append(b"not json " + PAD.encode() + b"\n" if index % 2 else b'{"no_at_ns": 1}\n')
        else:
            at_ns += step
            record = {"schema_version": 1, "event_type": tag, "at_ns": at_ns, "n": index, "pad": PAD}
            lines.append(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
        keys.append(at_ns)
    return lines, keys


async def _merged(paths: list[Path]) -> list[bytes]:
    return [line async for block in read_merged([(path, 0) for path in paths]) for line in block]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(observations=_steps, resets=_steps)
def test_the_block_merge_is_the_per_line_merge(
    observations: list[int | None], resets: list[int | None]
) -> None:
    """Same lines, same order as heapq.merge of the lines by their keys (stable: the first file wins ties)."""
    obs_lines, obs_keys = _lines(observations, "infer.cache_observation")
    reset_lines, reset_keys = _lines(resets, "infer.cache_state")
    with tempfile.TemporaryDirectory() as folder:
        paths = [Path(folder) / "ev.jsonl", Path(folder) / "ev.resets.jsonl"]
        paths[0].write_bytes(b"".join(obs_lines))
        paths[1].write_bytes(b"".join(reset_lines))
        served = asyncio.run(_merged(paths))
    expected = heapq.merge(
        zip(obs_keys, obs_lines, strict=True), zip(reset_keys, reset_lines, strict=True), key=lambda p: p[0]
    )
    assert served == [line for _, line in expected]


def test_a_missing_or_empty_file_leaves_the_other_as_it_is(tmp_path: Path) -> None:
    """One file alone passes unchanged, in its own order (even out of time order)."""
    lines = [orjson.dumps({"at_ns": at_ns}, option=orjson.OPT_APPEND_NEWLINE) for at_ns in (5, 3, 9)]
    (tmp_path / "ev.jsonl").write_bytes(b"".join(lines))
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert asyncio.run(_merged([tmp_path / "ev.jsonl", tmp_path / "missing.jsonl"])) == lines
    assert asyncio.run(_merged([tmp_path / "empty.jsonl", tmp_path / "ev.jsonl"])) == lines
