"""`GET /cache/evidence?proof=1`: the chain segments that prove the matching records (docs/evidence.md).

A record is proven by the checkpoint after it: that checkpoint's signature covers its `prev`,
which covers the line before it, and so on back. So the proof of the records that match is
the whole segments between checkpoints over their time span, from the checkpoint before it
(the anchor) to the one after it: in each of the pod's chains, so that a record missing from
either shows. The writers first checkpoint what they hold (`EvidenceWriter.checkpoint_now`),
and the segments stop at that checkpoint: records written meanwhile are not in this proof.

The answer is the raw lines (their exact bytes: the hashes are over them), each chain's runs
behind a `cachewitness.proof_chain` line naming its file, merged by `at_ns`, then one
`cachewitness.proof_read` line.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from proxy.evidence.chain import Mark, chained_fields, line_hash
from proxy.evidence.merge import merge_blocks
from proxy.evidence.reader import record_matches
from proxy.vocabulary import EventType

__all__ = [
    "ChainScan",
    "ProofRouter",
    "choose_ranges",
    "pod_marker",
    "proof_stream",
    "range_blocks",
    "scan_chain",
]

_CONTROL = b'{"event_type":"cachewitness.'  # how the proof's own lines start (orjson, no spaces)
_READ_BYTES = 256 * 1024

Position = tuple[int, int]  # (index of the file, oldest first; byte offset in it)


@dataclass
class _Segment:
    """The lines after one checkpoint up to the next (that one included)."""

    start: Position
    end: Position = (0, 0)
    last_line: Position = (0, 0)  # where its last line starts: the next segment's anchor
    first_at: int | None = None
    last_at: int | None = None

    def spans(self, at_ns: int) -> None:
        self.first_at = at_ns if self.first_at is None else min(self.first_at, at_ns)
        self.last_at = at_ns if self.last_at is None else max(self.last_at, at_ns)


@dataclass
class ChainScan:
    """One chain's files, held open from the scan to the read (a rotation renames, it does not move them)."""

    name: str
    handles: list[IO[bytes]] = field(default_factory=list)
    segments: list[_Segment] = field(default_factory=list)
    first_match: int | None = None  # the smallest and largest at_ns of the matching records
    last_match: int | None = None

    def spans(self, at_ns: int) -> None:
        self.first_match = at_ns if self.first_match is None else min(self.first_match, at_ns)
        self.last_match = at_ns if self.last_match is None else max(self.last_match, at_ns)

    def close(self) -> None:
        """Close the files."""
        for handle in self.handles:
            handle.close()


def _lines(handles: list[IO[bytes]]) -> Iterator[tuple[Position, bytes]]:
    """Where each whole line of the files starts, and the line, read in chunks."""
    for index, handle in enumerate(handles):
        carry, offset = b"", 0
        while chunk := handle.read(_READ_BYTES):
            data = carry + chunk
            start = 0
            while (newline := data.find(b"\n", start)) != -1:
                yield (index, offset + start), data[start : newline + 1]
                start = newline + 1
            offset += start
            carry = data[start:]


def scan_chain(
    name: str, files: Sequence[Path], stop: Mark | None, matches: Callable[[dict[str, Any]], bool]
) -> ChainScan:
    """One pass over a chain's files (oldest first): its segments, and the span of what matches."""
    scan = ChainScan(name)
    for path in files:
        try:
            scan.handles.append(open(path, "rb"))  # noqa: SIM115 -- closed by the scan, which outlives this loop
        except OSError:
            continue  # rotated away since it was listed
    segment: _Segment | None = None
    for (index, offset), line in _lines(scan.handles):
        if segment is None:
            segment = _Segment((index, offset))
        segment.last_line, segment.end = (index, offset), (index, offset + len(line))
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        at_ns = record.get("at_ns")
        if isinstance(at_ns, int):
            segment.spans(at_ns)
            if matches(record):
                scan.spans(at_ns)
        if stop is not None and _is_mark(record, line, stop):
            break
        if record.get("event_type") == EventType.EVIDENCE_CHECKPOINT:
            scan.segments.append(segment)
            segment = None
    if segment is not None:
        scan.segments.append(segment)
    return scan


def _is_mark(record: dict[str, Any], line: bytes, stop: Mark) -> bool:
    fields = chained_fields(record)
    return fields is not None and fields[0] == stop.seq and line_hash(line) == stop.head


def choose_ranges(scans: Sequence[ChainScan]) -> list[tuple[Position, Position] | None]:
    """For each chain, from the anchor before the matching records' time span to the end of the
    segment after it (None: none of its segments overlap the span)."""
    firsts = [s.first_match for s in scans if s.first_match is not None]
    lasts = [s.last_match for s in scans if s.last_match is not None]
    if not firsts or not lasts:
        return [None for _ in scans]
    first, last = min(firsts), max(lasts)
    ranges: list[tuple[Position, Position] | None] = []
    for scan in scans:
        chosen = [
            i
            for i, seg in enumerate(scan.segments)
            if seg.first_at is not None
            and seg.last_at is not None
            and seg.last_at >= first
            and seg.first_at <= last
        ]
        if not chosen:
            ranges.append(None)
            continue
        start = scan.segments[chosen[0] - 1].last_line if chosen[0] else scan.segments[0].start
        ranges.append((start, scan.segments[chosen[-1]].end))
    return ranges


async def range_blocks(scan: ChainScan, start: Position, end: Position) -> AsyncGenerator[list[bytes], None]:
    """The whole lines from `start` to `end`, a list per chunk read (split at "\\n" only)."""
    for index in range(start[0], end[0] + 1):
        handle = scan.handles[index]
        offset = start[1] if index == start[0] else 0
        # Files before the last one are rotated ones: they no longer grow.
        remaining = end[1] - offset if index == end[0] else None
        await asyncio.to_thread(handle.seek, offset)
        carry = b""
        while remaining is None or remaining > 0:
            want = _READ_BYTES if remaining is None else min(_READ_BYTES, remaining)
            chunk = await asyncio.to_thread(handle.read, want)
            if not chunk:
                break
            if remaining is not None:
                remaining -= len(chunk)
            data = carry + chunk
            cut = data.rfind(b"\n") + 1
            carry = data[cut:]
            if cut:
                yield [line + b"\n" for line in data[: cut - 1].split(b"\n")]


async def _nothing() -> AsyncGenerator[list[bytes], None]:
    return
    yield []  # an async generator that yields nothing


def _seq(line: bytes | None) -> int | None:
    if line is None:
        return None
    try:
        fields = chained_fields(orjson.loads(line))
    except orjson.JSONDecodeError:
        return None
    return fields[0] if fields is not None else None


async def proof_stream(
    chains: Sequence[tuple[str, list[Path], Mark | None]], filters: Mapping[str, Any]
) -> AsyncGenerator[bytes, None]:
    """The proof of the records matching `filters`, in writes: each chain's `(name, files oldest
    first, mark to stop at)` segments merged by `at_ns`, a marker before each run, the trailer."""
    matches = functools.partial(record_matches, **filters)
    scans: list[ChainScan] = []
    try:
        for name, files, mark in chains:
            scans.append(await asyncio.to_thread(scan_chain, name, files, mark, matches))
        ranges = choose_ranges(scans)
        sources = [
            range_blocks(scan, *span) if span else _nothing()
            for scan, span in zip(scans, ranges, strict=True)
        ]
        lines = [0] * len(scans)
        first: list[bytes | None] = [None] * len(scans)
        last: list[bytes | None] = [None] * len(scans)
        current = None
        async with aclosing(merge_blocks(sources)) as merged:
            async for index, block in merged:
                if index != current:
                    yield chain_marker(scans[index].name)
                    current = index
                lines[index] += len(block)
                first[index] = first[index] or block[0]
                last[index] = block[-1]
                yield b"".join(block)
        yield proof_trailer(
            [
                {"file": scan.name, "lines": lines[i], "first_seq": _seq(first[i]), "last_seq": _seq(last[i])}
                for i, scan in enumerate(scans)
            ]
        )
    finally:
        for scan in scans:
            await asyncio.to_thread(scan.close)


def chain_marker(name: str) -> bytes:
    """The line before a run of one chain's lines."""
    return orjson.dumps({"event_type": EventType.PROOF_CHAIN, "file": name}, option=orjson.OPT_APPEND_NEWLINE)


def proof_trailer(chains: list[dict[str, Any]]) -> bytes:
    """The last line of a proof: what each chain sent."""
    record = {
        "event_type": EventType.PROOF_READ,
        "schema_version": 1,
        "at_ns": time.time_ns(),
        "chains": chains,
    }
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


def pod_marker(pod: str) -> bytes:
    """The line before one pod's proof in a cluster's."""
    return orjson.dumps({"event_type": EventType.PROOF_POD, "pod": pod}, option=orjson.OPT_APPEND_NEWLINE)


@dataclass
class ProofRouter:
    """Follows a proof stream's control lines: which pod and chain the next raw line is of."""

    pod: str
    chain: str | None = None
    trailers: dict[str, dict[str, Any]] = field(default_factory=dict)  # pod -> its proof_read line

    def route(self, line: bytes) -> tuple[bool, str | None]:
        """Whether `line` is a control line (which moves the state), and the chain it is of
        (None: a line of no chain, outside every segment)."""
        if not line.startswith(_CONTROL):
            return False, self.chain
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            return False, self.chain
        kind = record.get("event_type") if isinstance(record, dict) else None
        if kind == EventType.PROOF_POD:
            self.pod, self.chain = str(record.get("pod")), None
        elif kind == EventType.PROOF_CHAIN:
            self.chain = str(record.get("file"))
        elif kind == EventType.PROOF_READ:
            self.trailers[self.pod] = record
            self.chain = None
        else:
            return False, self.chain
        return True, None
