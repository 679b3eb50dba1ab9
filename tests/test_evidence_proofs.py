"""`GET /cache/evidence?proof=inclusion` and `?proof=consistency` on a real sidecar's evidence.

A signed sidecar (checkpoints every 0.2 s) serves two sessions, A and B, interleaved across
several checkpoints. B's inclusion proof must hold B's records only, each proven to a signed
checkpoint; pymerkle (not ours) rebuilds each writer life's tree from the files on disk and must
find the same roots and accept the same audit paths; our checker must accept the answer whole
and name a record, a path or a checkpoint that was changed.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import orjson
import pytest
from pymerkle import InmemoryTree, verify_inclusion  # type: ignore[import-untyped]  # no type hints
from pymerkle.proof import InclusionProof  # type: ignore[import-untyped]

from proxy.evidence import merkle
from proxy.evidence.keys import SigningKey
from proxy.evidence.proof_check import ProofCheck
from tests.support.sidecar import Stack, stack
from tests.support.sim import chat, fast


def lives_on_disk(folder: Path, file: str) -> dict[str, list[bytes]]:
    """Each writer life's lines of one chain, oldest file first, by writer_id."""
    paths = [*sorted(folder.glob(file + ".*"), key=lambda p: -int(p.suffix[1:])), folder / file]
    lives: dict[str, list[bytes]] = {}
    current = None
    for path in paths:
        for line in path.read_bytes().splitlines(keepends=True):
            record = orjson.loads(line)
            if record["event_type"] == "infer.evidence_opened":
                current = record["writer_id"]
            lives.setdefault(str(current), []).append(line)
    return lives


async def session_chats(s: Stack, session: str, count: int) -> None:
    for n in range(count):
        async with s.http.post(
            s.url + "/v1/chat/completions", json=chat(f"{session} {n}"), headers={"X-Session-Id": session}
        ) as response:
            assert response.status == 200
            await response.read()


@pytest.fixture
async def signed(tmp_path: Path) -> Any:
    key = SigningKey.generate()
    (tmp_path / "key.pem").write_bytes(key.pem())
    async with stack(
        fast("vllm"), tmp_path, checkpoint_interval_s=0.2, evidence_signing_key_file=str(tmp_path / "key.pem")
    ) as s:
        for _round in range(3):
            await session_chats(s, "A", 2)
            await session_chats(s, "B", 2)
            status, _ = await get(s, "proof=inclusion&session_id=none")  # a checkpoint between rounds
            assert status == 200
        yield s, tmp_path / "evidence", key


async def get(s: Stack, query: str) -> tuple[int, bytes]:
    async with s.http.get(s.url + "/cache/evidence?" + query) as response:
        return response.status, await response.read()


async def test_an_inclusion_proof_holds_the_sessions_records_each_proven_to_a_signed_checkpoint(
    signed: Any,
) -> None:
    s, folder, key = signed
    status, body = await get(s, "proof=inclusion&session_id=B")
    assert status == 200
    lines = body.splitlines(keepends=True)
    entries = [orjson.loads(line) for line in lines]
    assert entries[-1]["event_type"] == "cachewitness.proof_read"
    inclusions = [e for e in entries if e["event_type"] == "cachewitness.inclusion"]
    records = [orjson.loads(e["line"]) for e in inclusions]
    assert len(records) == 6 and {r["session_id"] for r in records} == {"B"}
    checkpoints = {(e["file"], e["seq"]): e for e in entries if e["event_type"] == "cachewitness.checkpoint"}
    assert len({e["checkpoint_seq"] for e in inclusions}) >= 2  # the rounds fell under several checkpoints
    lives = lives_on_disk(folder, "cachewitness.jsonl")
    for entry in inclusions:
        held = orjson.loads(checkpoints[(entry["file"], entry["checkpoint_seq"])]["line"])
        life = lives[entry["writer_id"]]
        size, index = entry["tree_size"], entry["leaf_index"]
        assert life[index] == entry["line"].encode()  # the record exactly as on disk
        theirs = InmemoryTree(algorithm="sha256")
        for line in life[:size]:
            theirs.append_entry(line)
        root = base64.b64decode(held["root"])
        assert held["tree_size"] == size and theirs.get_root(size) == root
        leaf = merkle.leaf_hash(life[index])
        path = [bytes.fromhex(h) for h in entry["audit_path"]]
        rule = theirs.prove_inclusion(index + 1, size).rule
        verify_inclusion(leaf, root, InclusionProof("sha256", True, size, index + 1, rule, [leaf, *path]))
        assert len(path) <= (size - 1).bit_length()
    consistency = [e for e in entries if e["event_type"] == "cachewitness.consistency"]
    assert len(consistency) == len(checkpoints) - 1
    check = ProofCheck("B")
    for number, line in enumerate(lines, 1):
        check.feed(line, number)
    report = check.finish()
    assert report.whole and report.records == 6 and report.signed == len(checkpoints), report.problems
    assert report.keys == (key.public.fingerprint,)


def checked(lines: list[bytes]) -> tuple[str, ...]:
    check = ProofCheck("answer")
    for number, line in enumerate(lines, 1):
        check.feed(line, number)
    return check.finish().problems


def edit(lines: list[bytes], kind: str, change: Any) -> tuple[list[bytes], int]:
    """The answer with the first entry of `kind` changed by `change(entry)`; and its line number."""
    out = list(lines)
    number = next(i for i, line in enumerate(out) if orjson.loads(line)["event_type"] == kind)
    entry = orjson.loads(out[number])
    change(entry)
    out[number] = orjson.dumps(entry) + b"\n"
    return out, number + 1


async def test_a_changed_record_path_or_checkpoint_is_named(signed: Any) -> None:
    s, _, _ = signed
    _, body = await get(s, "proof=inclusion&session_id=B")
    lines = body.splitlines(keepends=True)
    assert checked(lines) == ()

    def record(entry: dict[str, Any]) -> None:
        entry["line"] = entry["line"].replace('"status":200', '"status":201')

    def path(entry: dict[str, Any]) -> None:
        entry["audit_path"][0] = "00" * 32

    def root(entry: dict[str, Any]) -> None:
        entry["line"] = entry["line"].replace('"root":"', '"root":"A', 1)

    def consistency(entry: dict[str, Any]) -> None:
        entry["proof"][-1] = "11" * 32

    for kind, change, says in (
        ("cachewitness.inclusion", record, "its audit path does not lead to the root of checkpoint seq"),
        ("cachewitness.inclusion", path, "its audit path does not lead to the root of checkpoint seq"),
        ("cachewitness.checkpoint", root, "bad signature"),
        ("cachewitness.consistency", consistency, "are not consistent: not one append-only log"),
    ):
        changed, number = edit(lines, kind, change)
        problems = checked(changed)
        assert any(p.startswith(f"answer:{number}: ") and says in p for p in problems), (kind, problems)
    # A checkpoint dropped from the answer: its records are not proven, nor its link to the next.
    number = next(i for i, line in enumerate(lines) if b'"cachewitness.checkpoint"' in line)
    problems = checked(lines[:number] + lines[number + 1 :])
    assert any("is not held (signed)" in p for p in problems), problems
    # A consistency proof dropped: two checkpoints of one life that nothing links.
    number = next(i for i, line in enumerate(lines) if b'"cachewitness.consistency"' in line)
    problems = checked(lines[:number] + lines[number + 1 :])
    assert any("no consistency proof links checkpoints seq" in p for p in problems), problems


async def test_a_consistency_proof_between_two_checkpoints(signed: Any) -> None:
    s, folder, _ = signed
    lives = lives_on_disk(folder, "cachewitness.jsonl")
    [life] = lives.values()
    seqs = [orjson.loads(line)["seq"] for line in life if b'"infer.evidence_checkpoint"' in line]
    status, body = await get(s, f"proof=consistency&from={seqs[0]}&to={seqs[-1]}")
    assert status == 200, body
    answer = orjson.loads(body)
    first, second = (orjson.loads(answer[k]["line"]) for k in ("from", "to"))
    theirs = InmemoryTree(algorithm="sha256")
    for line in life:
        theirs.append_entry(line)
    old, new = theirs.get_root(first["tree_size"]), theirs.get_root(second["tree_size"])
    assert (base64.b64decode(first["root"]), base64.b64decode(second["root"])) == (old, new)
    proof = [bytes.fromhex(h) for h in answer["proof"]]
    assert merkle.verify_consistency(first["tree_size"], second["tree_size"], old, new, proof)
    for query, param in (
        (f"proof=consistency&from={seqs[0]}", "to"),
        (f"proof=consistency&from={seqs[0] + 1}&to={seqs[-1]}", "from"),
        (f"proof=consistency&from={seqs[-1]}&to={seqs[0]}", "from"),
        (f"proof=consistency&from={seqs[0]}&to={seqs[-1]}&file=other.jsonl", "file"),
        (f"proof=consistency&from={seqs[0]}&to={seqs[-1]}&scope=cluster", "scope"),
        (f"proof=inclusion&from={seqs[0]}", "from"),
        ("proof=merkle", "proof"),
        ("proof=inclusion", "session_id"),
        ("proof=inclusion&event_type=infer.cache_observation", "session_id"),
    ):
        status, body = await get(s, query)
        assert status == 400 and orjson.loads(body)["error"]["param"] == param, (query, body)
