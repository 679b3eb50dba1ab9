"""Observation traffic rotating the evidence away (issue 45, L2): what an open case needs stays, and
every file a rotation drops is said in the resets file (proxy/evidence/log.py, proxy/recorder.py).

A sidecar in front of the simulator with a 16 KiB observation file and one rotation kept: a
few dozen requests rotate its history away, as 2.8 MB/s of records rotate the default 384 MiB.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import orjson

from proxy.evidence.log import EVIDENCE
from proxy.evidence.reader import evidence_files
from proxy.evidence.reserve import CASE_RESERVE
from tests.support.evidence_files import resets_file
from tests.support.sidecar import Stack, stack
from tests.support.sim import chat, fast, words

CASE = "X-Cachewitness-Case"
MAX_BYTES = 16 * 1024
SMALL: dict[str, Any] = {"evidence_max_bytes": MAX_BYTES, "evidence_keep": 1, "engine": "vllm"}


def _records(path: Path, keep: int) -> list[dict[str, Any]]:
    """Every record of a file and its rotations, oldest file first."""
    records: list[dict[str, Any]] = []
    for file in evidence_files(path, keep):
        records += [orjson.loads(line) for line in file.read_bytes().splitlines()]
    return records


async def _chat(s: Stack, tag: str, token: str | None = None, ids: tuple[str, str] | None = None) -> None:
    """One chat of a prompt of its own through the sidecar, with the case token and the
    session and case ids if given."""
    headers = {CASE: token} if token is not None else {}
    if ids is not None:
        headers |= {"X-Session-Id": ids[0], "X-Case-Id": ids[1]}
    body = chat(words(24, tag), max_tokens=1)
    async with s.http.post(f"{s.url}/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status == 200
        await response.read()


async def _flood(s: Stack, count: int) -> None:
    """Requests of nobody's case, enough to rotate the small observation file several times."""
    for index in range(count):
        await _chat(s, f"flood{index}")


async def test_a_bound_cases_own_requests_outlive_a_flood_within_the_reserve(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path, **SMALL) as s:
        status, answer = await s.reset({"bind": True, "verify": "none", "case_id": "kept"})
        assert status == 200, answer
        for index in range(CASE_RESERVE + 2):
            await _chat(s, f"own{index}", answer["case_token"])
        await _flood(s, 60)
        await s.app[EVIDENCE].flush()
    evidence = tmp_path / "evidence" / "cachewitness.jsonl"
    kept = [
        r
        for r in _records(resets_file(evidence), 5)
        if r["event_type"] == "infer.cache_observation" and r["reset_id"] == answer["reset_id"]
    ]
    assert len(kept) == CASE_RESERVE
    assert all(r["case_token_carried"] and r["case_id"] is None for r in kept)
    assert sorted(r["ordinal_since_reset"] for r in kept) == list(range(1, CASE_RESERVE + 1))
    # Past the reserve an own request is an observation like any other: in the file the flood rotates.
    observations = _records(evidence, 1)
    assert not [r for r in observations if r.get("case_token_carried")]


async def test_requests_tagged_with_the_cases_ids_have_a_reserve_of_their_own(tmp_path: Path) -> None:
    """Ids any client can send: a forger fills their reserve, never the case token's."""
    async with stack(fast("vllm"), tmp_path, **SMALL) as s:
        status, answer = await s.reset({"verify": "none", "session_id": "s1", "case_id": "c1"})
        assert status == 200, answer
        for index in range(CASE_RESERVE + 2):
            await _chat(s, f"tagged{index}", ids=("s1", "c1"))
        await _chat(s, "other-case", ids=("s1", "c2"))
        for index in range(2):
            await _chat(s, f"own{index}", answer["case_token"])
        await _flood(s, 40)
        await s.app[EVIDENCE].flush()
    kept = [
        r
        for r in _records(resets_file(tmp_path / "evidence" / "cachewitness.jsonl"), 5)
        if r["event_type"] == "infer.cache_observation"
    ]
    tagged = [r for r in kept if not r["case_token_carried"]]
    assert {(r["session_id"], r["case_id"]) for r in tagged} == {("s1", "c1")}
    assert sorted(r["ordinal_since_reset"] for r in tagged) == list(range(1, CASE_RESERVE + 1))
    assert len([r for r in kept if r["case_token_carried"]]) == 2


async def test_the_request_that_settles_a_verdict_outlives_a_flood(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path, **SMALL) as s:
        status, answer = await s.reset({"verify": "none"})
        assert status == 200, answer
        await _flood(s, 60)
        await s.app[EVIDENCE].flush()
    evidence = tmp_path / "evidence" / "cachewitness.jsonl"
    resets = _records(resets_file(evidence), 5)
    (verification,) = [r for r in resets if r["event_type"] == "infer.cache_verification"]
    (settled,) = [r for r in resets if r["event_type"] == "infer.cache_observation"]
    assert settled["request_id"] == verification["request_id"]
    assert settled["reset_id"] == answer["reset_id"] and settled["ordinal_since_reset"] == 1
    assert settled["request_id"] not in {r.get("request_id") for r in _records(evidence, 1)}


async def test_every_dropped_file_is_said_in_the_resets_file(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path, **SMALL) as s:
        await _flood(s, 80)
        await s.app[EVIDENCE].flush()
    evidence = tmp_path / "evidence" / "cachewitness.jsonl"
    notes = [r for r in _records(resets_file(evidence), 5) if r["event_type"] == "infer.evidence_rotated"]
    assert len(notes) >= 2
    assert {(n["file"], n["dropped_file"], n["keep"]) for n in notes} == {
        ("cachewitness.jsonl", "cachewitness.jsonl.1", 1)
    }
    # Together the notes account for every line that went: the first from seq 1, none skipped,
    # up to the line before the oldest file still on disk.
    assert notes[0]["first_seq"] == 1
    for earlier, later in itertools.pairwise(notes):
        assert later["first_seq"] == earlier["last_seq"] + 1
        assert later["first_at_ns"] >= earlier["last_at_ns"]
    assert all(0 < n["dropped_bytes"] <= 2 * MAX_BYTES for n in notes)
    oldest_left = _records(evidence, 1)[0]
    assert oldest_left["seq"] == notes[-1]["last_seq"] + 1
