"""Reading the evidence: one file and its rotations, oldest first, in bounded chunks, filtered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path

import orjson

__all__ = ["evidence_files", "read_evidence", "read_evidence_blocks", "record_matches", "rotated"]

_READ_CHUNK_BYTES = 256 * 1024


def rotated(path: Path, index: int) -> Path:
    """`cachewitness.jsonl.<index>`."""
    return path.with_name(f"{path.name}.{index}")


def evidence_files(path: Path, keep: int) -> list[Path]:
    """The evidence files that exist, oldest first: `.keep` … `.1`, then the current one."""
    files = [rotated(path, index) for index in range(keep, 0, -1)] + [path]
    return [f for f in files if f.exists()]


def _matches(
    line: bytes,
    session_id: str | None,
    case_id: str | None,
    event_type: str | None,
    since_ns: int | None,
) -> bool:
    """Whether one evidence line passes the filters (unparseable lines never do)."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return record_matches(
        record, session_id=session_id, case_id=case_id, event_type=event_type, since_ns=since_ns
    )


def record_matches(
    record: object,
    *,
    session_id: str | None = None,
    case_id: str | None = None,
    event_type: str | None = None,
    since_ns: int | None = None,
) -> bool:
    """Whether one parsed record passes the filters (only a JSON object may)."""
    if not isinstance(record, dict):
        return False
    if session_id is not None and record.get("session_id") != session_id:
        return False
    if case_id is not None and record.get("case_id") != case_id:
        return False
    if event_type is not None and record.get("event_type") != event_type:
        return False
    if since_ns is not None:
        at_ns = record.get("at_ns")
        if not isinstance(at_ns, int) or at_ns < since_ns:
            return False
    return True


async def read_evidence_blocks(
    path: Path,
    *,
    keep: int,
    session_id: str | None = None,
    case_id: str | None = None,
    event_type: str | None = None,
    since_ns: int | None = None,
) -> AsyncGenerator[list[bytes], None]:
    """Yield the matching evidence lines (each ending "\\n"), oldest file first, a list per chunk read.

    Reads in bounded chunks in a thread, so a big file streams. A last line
    without its newline is a write in progress and is not yielded.
    """
    filtered = any(v is not None for v in (session_id, case_id, event_type, since_ns))
    for file in evidence_files(Path(path), keep):
        try:
            handle = await asyncio.to_thread(open, file, "rb")
        except OSError:
            continue  # rotated away between listing and opening
        try:
            carry = b""
            while True:
                chunk = await asyncio.to_thread(handle.read, _READ_CHUNK_BYTES)
                if not chunk:
                    break
                data = carry + chunk
                block: list[bytes] = []
                start = 0
                newline = data.find(b"\n")
                while newline != -1:
                    line = data[start : newline + 1]
                    if not filtered or _matches(line, session_id, case_id, event_type, since_ns):
                        block.append(line)
                    start = newline + 1
                    newline = data.find(b"\n", start)
                carry = data[start:]
                if block:
                    yield block
        finally:
            await asyncio.to_thread(handle.close)


async def read_evidence(
    path: Path,
    *,
    keep: int,
    session_id: str | None = None,
    case_id: str | None = None,
    event_type: str | None = None,
    since_ns: int | None = None,
) -> AsyncGenerator[bytes, None]:
    """The lines of `read_evidence_blocks` one at a time (same filters)."""
    blocks = read_evidence_blocks(
        path, keep=keep, session_id=session_id, case_id=case_id, event_type=event_type, since_ns=since_ns
    )
    async with aclosing(blocks):
        async for block in blocks:
            for line in block:
                yield line
