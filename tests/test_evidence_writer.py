"""The evidence writer and reader against real files (proxy/evidence/writer.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, TypedDict, Unpack

import orjson
import pytest

from proxy.evidence.lines import CHAIN_SUFFIX_MAX, MAX_LINE_BYTES
from proxy.evidence.reader import read_evidence
from proxy.evidence.writer import DropReason, EvidenceWriter
from tests.support.evidence_files import CHAIN_EVENTS, unchained
from tests.support.tmpfs import resize, tmpfs


def record(n: int, **extra: object) -> dict[str, object]:
    """A small observation-like record."""
    return {
        "schema_version": 1,
        "event_type": "infer.cache_observation",
        "at_ns": n,
        "request_id": f"r{n}",
        **extra,
    }


def lines(path: Path) -> list[dict[str, Any]]:
    """Every record given to the writer in one file, the chain checked line by line (tests/evidence_files.py)."""
    return unchained(path.read_bytes())


class Filters(TypedDict, total=False):
    """read_evidence's filters."""

    session_id: str
    case_id: str
    event_type: str
    since_ns: int


async def collect(path: Path, keep: int, **filters: Unpack[Filters]) -> list[bytes]:
    """Everything read_evidence yields."""
    return [line async for line in read_evidence(path, keep=keep, **filters)]


async def test_flush_writes_queued_records_as_jsonl(tmp_path: Path) -> None:
    writer = EvidenceWriter(tmp_path / "ev" / "cachewitness.jsonl")
    writer.write(record(1))
    writer.write(record(2, note="é"))
    await writer.flush()
    assert lines(writer.path) == [record(1), record(2, note="é")]
    # The writer's life starts with its own record (tests/test_evidence_chain.py has its fields).
    assert writer.records_total == {"infer.evidence_opened": 1, "infer.cache_observation": 2}
    await writer.close()


async def test_flush_task_writes_without_being_asked(tmp_path: Path) -> None:
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl", flush_interval_s=0.05)
    await writer.start()
    writer.write(record(1))
    await asyncio.wait_for(writer.wait_flushed(), timeout=5)
    assert lines(writer.path) == [record(1)]
    await writer.close()


async def test_a_record_that_finds_a_flush_due_wakes_it_before_the_timer(tmp_path: Path) -> None:
    """Under traffic a flush is woken by the record that finds the oldest one flush_interval_s
    old, not by a timer (which would write both only 2 × flush_interval_s after the first)."""
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl", flush_interval_s=1.0)
    await writer.start()
    loop = asyncio.get_running_loop()
    first = loop.time()
    writer.write(record(1))
    await asyncio.sleep(1.05)
    writer.write(record(2))
    for _ in range(200):  # polled until 1.85 s after the first record, bounded
        if loop.time() - first >= 1.85 or (writer.path.exists() and len(lines(writer.path)) == 2):
            break
        await asyncio.sleep(0.01)
    assert lines(writer.path) == [record(1), record(2)], "not written before the 2 s timer"
    await writer.close()


async def test_wait_flushed_returns_while_nothing_is_queued(tmp_path: Path) -> None:
    # An idle writer has no flush timer (issue 34): asking for its next flush wakes it.
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl", flush_interval_s=0.05)
    await writer.start()
    await asyncio.wait_for(writer.wait_flushed(), timeout=5)  # the opening line
    await asyncio.wait_for(writer.wait_flushed(), timeout=5)  # nothing queued
    assert writer.records_total == {"infer.evidence_opened": 1}
    await writer.close()


async def test_rotation_keeps_n_files_each_under_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "cachewitness.jsonl"
    writer = EvidenceWriter(path, max_bytes=1000, keep=2)
    for n in range(100):
        writer.write(record(n))
    await writer.flush()
    await writer.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["cachewitness.jsonl", "cachewitness.jsonl.1", "cachewitness.jsonl.2"]
    assert all(p.stat().st_size <= 1000 for p in tmp_path.iterdir())
    kept = [
        orjson.loads(line)["at_ns"]
        for line in await collect(path, keep=2, event_type="infer.cache_observation")
    ]
    assert kept == list(range(100 - len(kept), 100)) and len(kept) > 10


async def test_close_loses_nothing(tmp_path: Path) -> None:
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl")
    await writer.start()
    for n in range(10_000):
        writer.write(record(n))
    await writer.close()
    assert [r["at_ns"] for r in lines(writer.path)] == list(range(10_000))
    assert writer.dropped_total == 0
    # One opening, and the final checkpoint close writes.
    assert writer.records_total == {
        "infer.evidence_opened": 1,
        "infer.cache_observation": 10_000,
        "infer.evidence_checkpoint": 1,
    }


async def test_write_after_close_is_dropped_and_counted(tmp_path: Path) -> None:
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl")
    await writer.close()
    writer.write(record(1))
    assert writer.dropped_total == 1


async def test_full_queue_drops_and_counts(tmp_path: Path) -> None:
    # What one waiting record counts for: its line, and room for the chain fields it will get.
    line_bytes = len(orjson.dumps(record(0))) + 1 + CHAIN_SUFFIX_MAX
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl", max_queue_bytes=3 * line_bytes)
    for n in range(5):
        writer.write(record(n))
    await writer.flush()
    assert writer.dropped == {**dict.fromkeys(DropReason, 0), DropReason.QUEUE_FULL: 2}
    assert len(lines(writer.path)) == 3


async def test_unwritable_path_is_counted_then_retried_when_fixed(tmp_path: Path) -> None:
    # A parent that is a regular file stops writes even for root (ENOTDIR/EEXIST).
    blocker = tmp_path / "evidence"
    blocker.write_bytes(b"not a directory")
    writer = EvidenceWriter(blocker / "cachewitness.jsonl")
    writer.write(record(1))
    await writer.flush()
    assert writer.write_errors_total == 1 and not writer.records_total
    blocker.unlink()
    writer.write(record(2))
    await writer.flush()
    assert lines(writer.path) == [record(1), record(2)]
    await writer.close()


async def test_disk_full_is_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    writer = EvidenceWriter(Path("/dev/full"))
    with caplog.at_level(logging.WARNING, logger="cachewitness.evidence"):
        for n in range(3):
            writer.write(record(n))
            await writer.flush()
        await writer.close()
    failures = [r for r in caplog.records if "evidence_write_failed" in r.getMessage()]
    # Three flushes and the final one at close each failed; the records are lost and counted:
    # the three, the writer's opening and its final checkpoint.
    assert writer.write_errors_total == 4 and len(failures) == 1
    assert writer.dropped == {**dict.fromkeys(DropReason, 0), DropReason.UNWRITABLE_AT_CLOSE: 5}
    assert orjson.loads(failures[0].getMessage())["error"] == "ENOSPC"


async def test_oversize_record_is_truncated_to_fit(tmp_path: Path) -> None:
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl")
    writer.write(record(1, calls=[{"url": "http://e/x", "body": "x" * 200_000}]))
    await writer.flush()
    (written,) = lines(writer.path)
    assert written["truncated"] is True and len(written["calls"][0]["body"]) < 2000
    assert writer.path.stat().st_size <= MAX_LINE_BYTES


async def test_record_that_cannot_fit_is_dropped_and_counted(tmp_path: Path) -> None:
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl")
    writer.write(record(1, many=list(range(20_000))))
    await writer.flush()
    assert writer.dropped_total == 1 and not writer.path.exists()


async def test_unencodable_record_never_raises(tmp_path: Path) -> None:
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl")
    writer.write(record(1, bad=object()))
    assert writer.dropped_total == 1


async def test_a_record_queued_unbuilt_is_built_at_the_flush_in_its_place(tmp_path: Path) -> None:
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl")
    built: list[int] = []

    def build() -> dict[str, object]:
        built.append(2)
        return record(2)

    writer.write(record(1))
    writer.write_later("infer.cache_observation", build)
    writer.write(record(3))
    assert built == []  # nothing built until the batch is
    await writer.flush()
    assert built == [2]
    assert lines(writer.path) == [record(1), record(2), record(3)]
    await writer.close()


async def test_a_record_that_cannot_be_built_is_counted_and_the_next_line_says_so(tmp_path: Path) -> None:
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl")

    def broken() -> dict[str, object]:
        raise ValueError("no record")

    writer.write_later("infer.cache_observation", broken)
    writer.write_later("infer.cache_observation", lambda: record(2))
    writer.write_later("infer.cache_observation", lambda: record(3, many=list(range(20_000))))  # cannot fit
    await writer.flush()
    # The last of a batch dropped: the first line queued after it carries the count.
    writer.write(record(4))
    await writer.close()
    assert writer.dropped == {
        **dict.fromkeys(DropReason, 0),
        DropReason.UNENCODABLE: 1,
        DropReason.RECORD_TOO_LARGE: 1,
    }
    assert lines(writer.path) == [record(2, dropped_before=1), record(4, dropped_before=1)]


async def test_close_builds_what_waits_unbuilt_and_drops_what_comes_after(tmp_path: Path) -> None:
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl")
    writer.write_later("infer.cache_observation", lambda: record(1))
    await writer.close()
    writer.write_later("infer.cache_observation", lambda: record(2))
    assert lines(writer.path) == [record(1)]
    assert writer.dropped == {**dict.fromkeys(DropReason, 0), DropReason.WRITER_CLOSED: 1}


async def test_stdout_copy_gets_each_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl", stdout=True)
    writer.write(record(7))
    await writer.close()
    assert capsys.readouterr().out == writer.path.read_text()


async def test_reader_filters_by_session_case_type_and_time(tmp_path: Path) -> None:
    path = tmp_path / "cachewitness.jsonl"
    writer = EvidenceWriter(path)
    writer.write(record(1, session_id="a", case_id="1"))
    writer.write(record(2, session_id="b", case_id="1"))
    writer.write({"schema_version": 1, "event_type": "infer.cache_state", "at_ns": 3, "session_id": "a"})
    await writer.close()
    assert len(await collect(path, keep=5, session_id="a")) == 2
    assert len(await collect(path, keep=5, case_id="1")) == 2
    assert len(await collect(path, keep=5, event_type="infer.cache_state")) == 1
    since = [orjson.loads(x) for x in await collect(path, keep=5, since_ns=2)]
    # The writer's opening and final checkpoint carry the time they were written: after 2 too.
    assert [r["at_ns"] for r in since if r["event_type"] not in CHAIN_EVENTS] == [2, 3]
    assert sorted(r["event_type"] for r in since if r["event_type"] in CHAIN_EVENTS) == sorted(CHAIN_EVENTS)


async def test_reader_skips_an_unfinished_last_line(tmp_path: Path) -> None:
    path = tmp_path / "cachewitness.jsonl"
    path.write_bytes(b'{"at_ns":1}\n{"at_ns":2')
    assert await collect(path, keep=5) == [b'{"at_ns":1}\n']


async def test_reader_streams_a_file_larger_than_its_read_chunk(tmp_path: Path) -> None:
    path = tmp_path / "cachewitness.jsonl"
    writer = EvidenceWriter(path)
    for n in range(20_000):
        writer.write(record(n, session_id="s" if n % 2 else "t"))
    await writer.close()
    assert path.stat().st_size > 1_000_000
    got = await collect(path, keep=5, session_id="s")
    assert [orjson.loads(x)["at_ns"] for x in got] == list(range(1, 20_000, 2))


class FsyncSpy:
    """Wraps `os.fsync` (the stdlib's, not ours): which files, by inode, were synced at what size."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import os

        self.synced: dict[int, int] = {}  # inode -> size when synced
        real = os.fsync

        def spy(fd: int) -> None:
            real(fd)
            info = os.fstat(fd)
            self.synced[info.st_ino] = info.st_size

        monkeypatch.setattr(os, "fsync", spy)

    def covers(self, path: Path) -> bool:
        """True when `path` was fsynced with everything it now holds."""
        info = path.stat()
        return self.synced.get(info.st_ino) == info.st_size


async def test_close_fsyncs_the_file_with_every_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = FsyncSpy(monkeypatch)
    path = tmp_path / "ev" / "cachewitness.jsonl"
    writer = EvidenceWriter(path)
    await writer.start()
    for n in range(20):
        writer.write(record(n))
    await writer.close()
    assert len(lines(path)) == 20
    assert spy.covers(path), spy.synced


async def test_rotation_fsyncs_each_file_it_rotates_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = FsyncSpy(monkeypatch)
    path = tmp_path / "ev" / "cachewitness.jsonl"
    writer = EvidenceWriter(path, max_bytes=1000, keep=3)
    for n in range(40):
        writer.write(record(n, pad="x" * 40))
        await writer.flush()
    rotated = [path.with_name(path.name + f".{index}") for index in (1, 2, 3)]
    assert all(p.exists() for p in rotated)
    assert all(spy.covers(p) for p in rotated), spy.synced
    await writer.close()


async def test_a_full_disk_takes_what_fits_and_the_rest_when_space_returns(tmp_path: Path) -> None:
    """On a 64 KiB tmpfs the lines that fit are written (not all or nothing), whole; the rest
    wait, and are written, in order, once the disk has room again."""
    with tmpfs(tmp_path / "disk", "64k") as disk:
        writer = EvidenceWriter(disk / "cachewitness.jsonl")
        for n in range(1000):
            writer.write(record(n, pad="p" * 150))
        await writer.flush()
        written = lines(writer.path)
        assert 150 < len(written) < 1000 and writer.path.read_bytes().endswith(b"\n")
        assert [r["at_ns"] for r in written] == list(range(len(written)))
        assert writer.records_total == {"infer.evidence_opened": 1, "infer.cache_observation": len(written)}
        assert writer.write_errors_total >= 1 and writer.dropped_total == 0
        resize(disk, "1m")
        await writer.close()
        assert [r["at_ns"] for r in lines(writer.path)] == list(range(1000))
        assert writer.pending_bytes == 0
        assert writer.records_total == {
            "infer.evidence_opened": 1,
            "infer.cache_observation": 1000,
            "infer.evidence_checkpoint": 1,
        }


async def test_on_a_full_disk_every_record_is_written_or_counted_lost(tmp_path: Path) -> None:
    """The queue is bounded in bytes: past it records are dropped, and written + dropped = produced."""
    with tmpfs(tmp_path / "disk", "64k") as disk:
        line_bytes = len(orjson.dumps(record(0, pad="p" * 150))) + 1 + CHAIN_SUFFIX_MAX
        writer = EvidenceWriter(disk / "cachewitness.jsonl", max_queue_bytes=200 * line_bytes)
        for n in range(5000):
            writer.write(record(n, pad="p" * 150))
            if n % 100 == 0:
                await writer.flush()
                assert writer.pending_bytes <= 200 * line_bytes
        await writer.close()
        on_disk = len(lines(writer.path))
        declared = [
            orjson.loads(line).get("dropped_before", 0) for line in writer.path.read_bytes().splitlines()
        ]
    assert writer.dropped[DropReason.QUEUE_FULL] > 0
    assert on_disk == writer.records_total["infer.cache_observation"]
    # The disk is still full at close: its final checkpoint is lost with the records still waiting.
    assert on_disk + writer.dropped_total == 5000 + 1
    # The disk never took a line after the first drop: no line on it declares one (the lines that
    # did are lost with the disk; tests/test_evidence_chain_disk.py has space return, and counts).
    assert sum(declared) == 0


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_a_waiting_record_costs_about_its_length_in_memory(tmp_path: Path) -> None:
    """20,000 records waiting for the disk hold about their bytes, not orjson's ~8 KB buffer each
    (the queue bound in bytes would otherwise bound a tenth of the memory it holds)."""
    writer = EvidenceWriter(tmp_path / "cachewitness.jsonl")  # not started: nothing is flushed
    before = _rss_bytes()
    for n in range(20_000):
        writer.write(record(n, request_id=f"{n:032x}", model="sim-model", outcome="ok", status=200))
    grown = _rss_bytes() - before
    assert writer.pending_bytes > 2_000_000
    assert grown < 3 * writer.pending_bytes, (grown, writer.pending_bytes)
    await writer.close()
