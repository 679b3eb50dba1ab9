"""The evidence's hash chain and signed checkpoints, on the files of a real `python -m proxy serve`.

One sidecar run (signing key, checkpoints every 0.2 s, rotation every 4 KB) writes the log the
tampering tests copy and edit; `cachewitness evidence verify` must name each kind of edit. The
checks in `independent_check` recompute every link and signature with hashlib and cryptography
alone, so a bug the writer and the verifier would share (a prev of the wrong line, a signature
over the wrong bytes) still fails here.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from proxy.cli import main
from proxy.evidence.keys import SigningKey
from proxy.evidence.merkle import CompactTree, leaf_hash
from proxy.evidence.note import signed_note
from proxy.evidence.proof import proof_stream
from proxy.evidence.writer import EvidenceWriter
from proxy.sim import running_sim
from tests.support.process import start_sidecar
from tests.support.sidecar import stack
from tests.support.sim import chat, fast

WAIT_S = 60.0
ZERO = "0" * 64
SIGNED_PREFIX = b"cachewitness evidence checkpoint v1\n"  # docs/evidence.md
OBSERVATION = b'"event_type":"infer.cache_observation"'


@dataclass(frozen=True)
class Log:
    """A finished sidecar run's evidence folder and the key pair that signed it."""

    folder: Path
    key: Path

    @property
    def public_key(self) -> Path:
        return self.key.with_name(self.key.name + ".pub")


def files_oldest_first(evidence: Path) -> list[Path]:
    """`ev.jsonl.N` … `ev.jsonl.1`, `ev.jsonl`."""
    rotated = sorted(evidence.parent.glob(evidence.name + ".*"), key=lambda p: -int(p.name.rsplit(".", 1)[1]))
    return [*rotated, evidence]


def all_lines(evidence: Path) -> list[bytes]:
    return [line for f in files_oldest_first(evidence) for line in f.read_bytes().splitlines(keepends=True)]


def independent_check(lines: list[bytes], public_key: Path) -> None:
    """Every link and signature as docs/evidence.md defines them, with no code of the sidecar's."""
    key = serialization.load_pem_public_key(public_key.read_bytes())
    assert isinstance(key, Ed25519PublicKey)
    for before, line in itertools.pairwise(lines):
        record, previous = orjson.loads(line), orjson.loads(before)
        assert record["prev"] == hashlib.sha256(before).hexdigest(), line
        assert record["seq"] == previous["seq"] + 1, line
    checkpoints = [line for line in lines if b'"event_type":"infer.evidence_checkpoint"' in line]
    assert checkpoints
    for line in checkpoints:
        signature = orjson.loads(line)["signature"]
        suffix = b',"signature":"' + signature.encode() + b'"}\n'
        assert line.endswith(suffix)
        key.verify(base64.b64decode(signature), SIGNED_PREFIX + line[: -len(suffix)] + b"}")


async def chats(proxy: str, count: int, session_id: str, pause_every: int = 5) -> None:
    """`count` chat requests through the sidecar, pausing past a checkpoint every few."""
    async with aiohttp.ClientSession() as client:
        for n in range(count):
            body = chat(f"chain request {n}")
            async with client.post(
                proxy + "/v1/chat/completions", json=body, headers={"X-Session-Id": session_id}
            ) as response:
                assert response.status == 200
                await response.read()
            if n % pause_every == pause_every - 1:
                await asyncio.sleep(0.3)  # past checkpoint_interval_s: a checkpoint between


async def stop(process: asyncio.subprocess.Process) -> None:
    process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(process.wait(), timeout=WAIT_S) == 0


async def run_sidecar(folder: Path, *extra: str, requests: int = 30, session_id: str = "chain") -> None:
    """One sidecar life over `folder`'s evidence: a reset, `requests` chats, SIGTERM."""
    async with running_sim(fast("vllm")) as engine:
        process, proxy = await start_sidecar(engine, folder, "--checkpoint-interval-s", "0.2", *extra)
        try:
            async with (
                aiohttp.ClientSession() as client,
                client.post(proxy + "/cache/reset", json={"session_id": session_id, "verify": "none"}) as r,
            ):
                assert r.status == 200, await r.text()
            await chats(proxy, requests, session_id)
        finally:
            await stop(process)


@pytest.fixture(scope="module")
def signed_log(tmp_path_factory: pytest.TempPathFactory) -> Log:
    """A signed, rotated log of one sidecar run (made once for this module)."""
    folder = tmp_path_factory.mktemp("signed")
    key = folder / "key.pem"
    made = subprocess.run(
        [sys.executable, "-m", "proxy", "keygen", "-o", str(key)], capture_output=True, text=True, timeout=60
    )
    assert made.returncode == 0, made.stderr
    rotation = ("--evidence-max-bytes", "4000", "--evidence-keep", "9")
    asyncio.run(run_sidecar(folder, "--evidence-signing-key-file", str(key), *rotation))
    return Log(folder, key)


def verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`cachewitness evidence verify ARGS`: exit code and what it printed."""
    code = main(["evidence", "verify", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture
def copy(signed_log: Log, tmp_path: Path) -> Path:
    """A copy of the signed run's evidence to edit: the path of its current observation file."""
    target = tmp_path / "log"
    shutil.copytree(signed_log.folder, target)
    return target / "ev.jsonl"


def test_the_run_verifies_whole_with_its_key_and_by_hand(
    signed_log: Log, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 0, one line per file's chain; and every link and signature holds by hand too."""
    evidence = signed_log.folder / "ev.jsonl"
    assert len(files_oldest_first(evidence)) >= 4  # rotated
    independent_check(all_lines(evidence), signed_log.public_key)
    independent_check(all_lines(signed_log.folder / "ev.resets.jsonl"), signed_log.public_key)
    code, out = verify(capsys, str(signed_log.folder), "--public-key", str(signed_log.public_key))
    assert code == 0, out
    whole = [line for line in out.splitlines() if ": whole: " in line]
    assert len(whole) == 2 and "closed" in whole[0] and "BROKEN" not in out


def _edit(path: Path, number: int, change: bytes | None) -> None:
    """Replace line `number` (1-based) of a file with `change`, or delete it (None)."""
    lines = path.read_bytes().splitlines(keepends=True)
    if change is None:
        del lines[number - 1]
    else:
        lines[number - 1] = change
    path.write_bytes(b"".join(lines))


def _observation_line(path: Path) -> int:
    """The number of a file's first observation line with a line before and after it in the file."""
    lines = path.read_bytes().splitlines()
    return next(i for i, line in enumerate(lines[1:-1], 2) if OBSERVATION in line)


def test_an_edited_byte_is_named(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = files_oldest_first(copy)[1]
    number = _observation_line(target)
    line = target.read_bytes().splitlines(keepends=True)[number - 1]
    edited = line.replace(b'"status":200', b'"status":201')
    assert edited != line
    _edit(target, number, edited)
    code, out = verify(capsys, str(copy))
    assert code == 1
    assert f"{target}:{number + 1}: prev is not the hash of the line before it" in out


def test_a_deleted_line_is_named(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = files_oldest_first(copy)[1]
    number = _observation_line(target)
    _edit(target, number, None)
    code, out = verify(capsys, str(copy))
    assert code == 1 and f"{target}:{number}: " in out and "1 record missing (lines deleted)" in out


def test_two_swapped_lines_are_named(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = files_oldest_first(copy)[1]
    number = _observation_line(target)
    lines = target.read_bytes().splitlines(keepends=True)
    lines[number - 1], lines[number] = lines[number], lines[number - 1]
    target.write_bytes(b"".join(lines))
    code, out = verify(capsys, str(copy))
    assert code == 1 and f"{target}:{number + 1}: " in out and "lines reordered, or one inserted" in out


def test_an_inserted_line_that_links_to_the_one_before_is_named(
    copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A forged line with the right prev and seq: the line after it no longer links."""
    target = files_oldest_first(copy)[1]
    number = _observation_line(target)
    lines = target.read_bytes().splitlines(keepends=True)
    record = orjson.loads(lines[number - 1])
    forged = {**record, "request_id": "forged", "seq": record["seq"] + 1}
    forged["prev"] = hashlib.sha256(lines[number - 1]).hexdigest()
    lines.insert(number, orjson.dumps(forged, option=orjson.OPT_APPEND_NEWLINE))
    target.write_bytes(b"".join(lines))
    code, out = verify(capsys, str(copy))
    assert code == 1 and f"{target}:{number + 2}: " in out and "lines reordered, or one inserted" in out


def test_a_line_with_seq_0_is_not_a_chained_line(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Seqs start at 1: a line claiming seq 0 (its prev left as it was) is named as no chained record."""
    target = files_oldest_first(copy)[1]
    number = _observation_line(target)
    lines = target.read_bytes().splitlines(keepends=True)
    record = orjson.loads(lines[number - 1])
    lines[number - 1] = orjson.dumps({**record, "seq": 0}, option=orjson.OPT_APPEND_NEWLINE)
    target.write_bytes(b"".join(lines))
    code, out = verify(capsys, str(copy))
    assert code == 1
    assert f"{target}:{number}: not a chained evidence record" in out, out


def test_a_removed_rotated_file_is_named(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = files_oldest_first(copy)
    files[1].unlink()
    code, out = verify(capsys, str(copy))
    assert code == 1
    assert (
        f"{files[2]}:1: " in out and f"at the end of {files[0]}" in out and "a rotated file removed?" in out
    )


async def test_a_cut_tail_says_how_many_records_no_checkpoint_proves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Cut a log before a checkpoint: the records after the one before it are named unproven."""
    await run_sidecar(tmp_path, requests=6)
    evidence = tmp_path / "ev.jsonl"
    lines = evidence.read_bytes().splitlines(keepends=True)
    checkpoints = [i for i, line in enumerate(lines) if b"infer.evidence_checkpoint" in line]
    cut = max(i for i in checkpoints if i - 1 not in checkpoints)  # one with records before it
    evidence.write_bytes(b"".join(lines[:cut]))
    code, out = verify(capsys, str(evidence))
    assert code == 1
    earlier = [i for i in checkpoints if i < cut]
    if earlier:
        seq = orjson.loads(lines[earlier[-1]])["seq"]
        count = cut - earlier[-1] - 1
        plural = "s" if count > 1 else ""
        assert f"{count} record{plural} after the last checkpoint (seq {seq}) cannot be proven" in out, out
    else:
        assert f"{cut} records cannot be proven: no checkpoint among them" in out, out


def test_a_replaced_signature_is_named(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = copy.read_bytes().splitlines(keepends=True)
    number = max(i for i, line in enumerate(lines, 1) if b"infer.evidence_checkpoint" in line)
    signature = orjson.loads(lines[number - 1])["signature"]
    other = base64.b64encode(bytes(64)).decode()
    _edit(copy, number, lines[number - 1].replace(signature.encode(), other.encode()))
    seq = orjson.loads(lines[number - 1])["seq"]
    code, out = verify(capsys, str(copy))
    assert code == 1 and f"{copy}:{number}: checkpoint seq {seq}: bad signature" in out


def test_another_key_is_refused_when_one_is_given(
    signed_log: Log, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other.pem"
    assert main(["keygen", "-o", str(other)]) == 0
    capsys.readouterr()
    code, out = verify(capsys, str(signed_log.folder / "ev.jsonl"), "--public-key", str(other) + ".pub")
    assert code == 1 and "not by the given key" in out


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = verify(capsys, str(tmp_path / "missing.jsonl"))
    assert code == 2 and "no such file" in out
    (tmp_path / "empty.jsonl").write_bytes(b"")
    code, out = verify(capsys, str(tmp_path / "empty.jsonl"))
    assert code == 2 and "no evidence records" in out


def test_keygen_never_overwrites_and_keeps_the_private_key_private(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "k.pem"
    assert main(["keygen", "-o", str(key)]) == 0
    assert "fingerprint sha256:" in capsys.readouterr().out
    assert (key.stat().st_mode & 0o777) == 0o600 and b"PUBLIC KEY" in (tmp_path / "k.pem.pub").read_bytes()
    before = key.read_bytes()
    assert main(["keygen", "-o", str(key)]) == 2
    assert "never overwrites" in capsys.readouterr().err and key.read_bytes() == before


def test_a_key_file_that_is_no_key_is_refused_at_start_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEWITNESS_")}
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--evidence", str(tmp_path / "ev.jsonl"),
         "--evidence-signing-key-file", str(bad), "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "evidence_signing_key_file" in line and str(bad) in line and "Traceback" not in done.stderr


async def test_a_restart_continues_the_chain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two lives over one log: the second opens at the first's last seq + 1, linked to its last line."""
    await run_sidecar(tmp_path, requests=3)
    first = (tmp_path / "ev.jsonl").read_bytes()
    await run_sidecar(tmp_path, requests=3)
    lines = (tmp_path / "ev.jsonl").read_bytes().splitlines(keepends=True)
    assert b"".join(lines).startswith(first)  # the first life's lines stay as they were
    last = first.splitlines(keepends=True)[-1]
    opened = orjson.loads(lines[len(first.splitlines())])
    assert opened["event_type"] == "infer.evidence_opened"
    assert (opened["resumed_from_seq"], opened["seq"]) == (
        orjson.loads(last)["seq"],
        orjson.loads(last)["seq"] + 1,
    )
    assert opened["prev"] == hashlib.sha256(last).hexdigest() and opened["broken_predecessor"] is False
    code, out = verify(capsys, str(tmp_path / "ev.jsonl"))
    assert code == 0 and "2 writer lives" in out and "0 signed" in out, out


@pytest.mark.parametrize(
    "tail", [b'{"event_type":"infer.cache_observ', b'{"foreign": "line"}\n'], ids=["cut", "foreign"]
)
async def test_a_corrupt_or_foreign_last_line_starts_a_new_chain(
    tmp_path: Path, tail: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    """No crash, old bytes never rewritten, `broken_predecessor: true`, the sidecar's log says so,
    and verify names both the bad line and the restart."""
    await run_sidecar(tmp_path, requests=2)
    evidence = tmp_path / "ev.jsonl"
    with open(evidence, "ab") as handle:
        handle.write(tail)
    before = evidence.read_bytes()
    await run_sidecar(tmp_path, requests=2)
    after = evidence.read_bytes()
    assert after.startswith(before)
    found = before if before.endswith(b"\n") else before + b"\n"  # a cut line is ended, not changed
    bad = found.splitlines(keepends=True)[-1]
    opened = orjson.loads(after[len(found) :].splitlines()[0])
    assert opened["event_type"] == "infer.evidence_opened" and opened["broken_predecessor"] is True
    assert (opened["seq"], opened["resumed_from_seq"]) == (1, 0)
    assert opened["prev"] == hashlib.sha256(bad).hexdigest()
    assert "evidence_chain_broken_predecessor" in (tmp_path / "sidecar.log").read_text()
    number = len(found.splitlines())
    code, out = verify(capsys, str(evidence))
    assert code == 1
    assert f"{evidence}:{number}: not a chained evidence record" in out
    assert f"{evidence}:{number + 1}: the chain restarts" in out


async def test_state_names_the_signing_key(signed_log: Log, tmp_path: Path) -> None:
    key = serialization.load_pem_public_key(signed_log.public_key.read_bytes())
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    async with running_sim(fast("vllm")) as engine:
        process, proxy = await start_sidecar(
            engine, tmp_path, "--evidence-signing-key-file", str(signed_log.key)
        )
        try:
            async with aiohttp.ClientSession() as client, client.get(proxy + "/cache/state") as response:
                state = await response.json()
        finally:
            await stop(process)
    assert state["sidecar"]["evidence_key_fingerprint"] == "sha256:" + hashlib.sha256(raw).hexdigest()
    opened = orjson.loads((tmp_path / "ev.jsonl").read_bytes().splitlines()[0])
    assert opened["key_fingerprint"] == state["sidecar"]["evidence_key_fingerprint"]


def test_a_fresh_log_starts_at_seq_1_after_64_zeros(signed_log: Log) -> None:
    first = orjson.loads((signed_log.folder / "ev.resets.jsonl").read_bytes().splitlines()[0])
    assert (first["event_type"], first["seq"], first["prev"], first["resumed_from_seq"]) == (
        "infer.evidence_opened",
        1,
        ZERO,
        0,
    )


async def test_a_proof_holds_the_segments_around_its_session_and_not_an_earlier_one(tmp_path: Path) -> None:
    """`?proof=1&session_id=B`: B's records with the chain around them, each file's part ending at a
    checkpoint, whole; session A, checkpointed before B began, is not in it."""
    async with stack(fast("vllm"), tmp_path, checkpoint_interval_s=3600.0) as s:
        for session in ("A", "B"):
            for n in range(2):
                async with s.http.post(
                    s.url + "/v1/chat/completions",
                    json=chat(f"{session} {n}"),
                    headers={"X-Session-Id": session},
                ) as response:
                    assert response.status == 200
                    await response.read()
            async with s.http.get(s.url + f"/cache/evidence?proof=1&session_id={session}") as response:
                assert response.status == 200
                proof = await response.read()
        async with s.http.get(s.url + "/cache/evidence?proof=1") as response:
            everything = await response.read()
        async with s.http.get(s.url + "/cache/evidence?proof=2") as response:
            assert response.status == 400 and (await response.json())["error"]["param"] == "proof"
    lines = proof.splitlines(keepends=True)
    trailer = orjson.loads(lines[-1])
    assert trailer["event_type"] == "cachewitness.proof_read"
    chains: dict[str, list[bytes]] = {}
    current = None
    for line in lines[:-1]:
        record = orjson.loads(line)
        if record["event_type"] == "cachewitness.proof_chain":
            current = record["file"]
            continue
        assert current is not None
        chains.setdefault(current, []).append(line)
    sessions = [orjson.loads(line).get("session_id") for part in chains.values() for line in part]
    assert sessions.count("B") == 2 and "A" not in sessions
    observations = chains["cachewitness.jsonl"]
    # The file's tail as it was when the proof was asked (the final checkpoint came at shutdown).
    on_disk = (tmp_path / "evidence" / "cachewitness.jsonl").read_bytes().splitlines(keepends=True)
    assert orjson.loads(on_disk[-1])["final"] is True
    assert observations == on_disk[-len(observations) - 1 : -1]
    for part in chains.values():
        assert orjson.loads(part[-1])["event_type"] == "infer.evidence_checkpoint"
        for before, line in itertools.pairwise(part):
            assert orjson.loads(line)["prev"] == hashlib.sha256(before).hexdigest()
    # Without a filter: each file whole, each ending at a checkpoint (the resets file's opening too).
    ends = {}
    for line in everything.splitlines():
        record = orjson.loads(line)
        if record["event_type"] == "cachewitness.proof_chain":
            current = record["file"]
        elif record["event_type"] != "cachewitness.proof_read":
            ends[current] = record["event_type"]
    assert ends == dict.fromkeys(
        ("cachewitness.jsonl", "cachewitness.resets.jsonl"), "infer.evidence_checkpoint"
    )
    # The resets file has no line in B's time span (its opening was checkpointed before B began).
    assert {c["file"]: c["lines"] for c in trailer["chains"]} == {
        "cachewitness.jsonl": len(observations),
        "cachewitness.resets.jsonl": 0,
    }


def relinked(lines: list[bytes]) -> list[bytes]:
    """The lines renumbered from the first one's seq and each prev recomputed: a rewrite by hand."""
    out: list[bytes] = []
    for line in lines:
        record = orjson.loads(line)
        if out:
            before = orjson.loads(out[-1])
            record["seq"], record["prev"] = before["seq"] + 1, hashlib.sha256(out[-1]).hexdigest()
        out.append(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
    return out


async def test_a_record_removed_and_the_chain_rewritten_is_caught_by_the_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unsigned log rewritten whole without one observation links and numbers well; the
    checkpoint after it still counts the record that is gone. One checkpoint only (the final one):
    a periodic one between the chats would count fewer than all three."""
    await run_sidecar(tmp_path, "--checkpoint-interval-s", "3600", requests=3)
    evidence = tmp_path / "ev.jsonl"
    lines = evidence.read_bytes().splitlines(keepends=True)
    number = next(i for i, line in enumerate(lines, 1) if OBSERVATION in line)
    evidence.write_bytes(b"".join(relinked(lines[: number - 1] + lines[number:])))
    code, out = verify(capsys, str(evidence))
    assert (
        code == 1
        # Three chats; the first decided the reset's verdict and is in the resets file.
        and "counts {'infer.cache_observation': 2" in out
        and "records since the last one are" in out
    )


async def test_a_proof_stops_at_the_checkpoint_it_asked_for(tmp_path: Path) -> None:
    """Records written after a proof's checkpoint (while it is read) are not in it."""
    writer = EvidenceWriter(tmp_path / "ev.jsonl", checkpoint_interval_s=3600.0)
    await writer.start()
    now = time.time_ns()
    for n in range(3):
        writer.write({"schema_version": 1, "event_type": "infer.cache_observation", "at_ns": now + n})
    mark = await writer.checkpoint_now()
    assert mark is not None
    writer.write({"schema_version": 1, "event_type": "infer.cache_observation", "at_ns": now + 3})
    await writer.flush()
    proof = [data async for data in proof_stream([("ev.jsonl", [writer.path], mark)], {})]
    await writer.close()
    lines = b"".join(proof).splitlines()
    chained = [orjson.loads(line) for line in lines if b'"seq":' in line]
    assert chained[-1]["event_type"] == "infer.evidence_checkpoint" and chained[-1]["seq"] == mark.seq
    assert [r["at_ns"] for r in chained if r["event_type"] == "infer.cache_observation"] == [
        now,
        now + 1,
        now + 2,
    ]


def resigned(lines: list[bytes], life: list[bytes], key: SigningKey) -> list[bytes]:
    """`relinked`, every checkpoint among them signed again by `key` (naming it), with the tree size,
    root and note of the life's lines before it (`life`: the lines of the life before `lines`)."""
    tree = CompactTree()
    for line in life:
        tree.append(leaf_hash(line))
    out: list[bytes] = []
    for line in lines:
        record = orjson.loads(line)
        if out:
            record["seq"], record["prev"] = (
                orjson.loads(out[-1])["seq"] + 1,
                hashlib.sha256(out[-1]).hexdigest(),
            )
        elif life:
            record["prev"] = hashlib.sha256(life[-1]).hexdigest()
        if record["event_type"] == "infer.evidence_checkpoint":
            del record["signature"]
            record["public_key"], record["key_fingerprint"] = key.public.text, key.public.fingerprint
            origin = record["note"].split("\n")[0]
            record["tree_size"], record["root"] = tree.size, base64.b64encode(tree.root()).decode()
            record["note"] = signed_note(origin, tree.size, tree.root(), key)
            body = orjson.dumps(record)
            out.append(body[:-1] + b',"signature":"%s"}\n' % key.sign(body).encode())
        else:
            out.append(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
        tree.append(leaf_hash(out[-1]))
    return out


def test_a_key_change_within_one_writer_life_is_named_without_a_pinned_key(
    copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each checkpoint from the third on re-signed by another key, every signature valid for the key
    its checkpoint names, the chain relinked: one writer's life cannot change keys."""
    lines = all_lines(copy)
    checkpoints = [i for i, line in enumerate(lines) if b'"event_type":"infer.evidence_checkpoint"' in line]
    cut = checkpoints[2]
    forged = lines[:cut] + resigned(lines[cut:], lines[:cut], SigningKey.generate())
    one = tmp_path / "forged" / "ev.jsonl"
    one.parent.mkdir()
    one.write_bytes(b"".join(forged))
    writer = orjson.loads(lines[0])["writer_id"]
    code, out = verify(capsys, str(one))
    assert code == 1, out
    assert f"{one}:{cut + 1}: checkpoint seq {orjson.loads(forged[cut])['seq']}: the key changed within " \
        f"writer {writer}'s life" in out  # fmt: skip


async def test_a_proof_starts_at_its_anchor_checkpoint(tmp_path: Path) -> None:
    """Session B's proof starts with the checkpoint before B's records (signed, it anchors their
    chain), and holds none of session A's records before it."""
    writer = EvidenceWriter(tmp_path / "ev.jsonl", checkpoint_interval_s=3600.0)
    await writer.start()
    now = time.time_ns()
    marks = []
    for session in ("A", "B"):
        for n in range(3):
            record = {"schema_version": 1, "event_type": "infer.cache_observation", "at_ns": now + n}
            writer.write({**record, "session_id": session})
        now += 10**12  # B's records come long after A's checkpoint
        marks.append(await writer.checkpoint_now())
    anchor, mark = marks
    assert anchor is not None and mark is not None
    proof = [data async for data in proof_stream([("ev.jsonl", [writer.path], mark)], {"session_id": "B"})]
    await writer.close()
    chained = [orjson.loads(line) for line in b"".join(proof).splitlines() if b'"seq":' in line]
    assert (chained[0]["event_type"], chained[0]["seq"]) == ("infer.evidence_checkpoint", anchor.seq)
    assert [r.get("session_id") for r in chained[1:-1]] == ["B"] * 3
    assert chained[-1]["seq"] == mark.seq


async def test_a_restart_after_rotation_continues_from_the_newest_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first life rotates its file several times; the second links to the last line written,
    which is in the current file, not in the oldest one kept."""
    rotation = ("--evidence-max-bytes", "4000", "--evidence-keep", "9")
    await run_sidecar(tmp_path, *rotation, requests=12)
    first = all_lines(tmp_path / "ev.jsonl")
    assert len(files_oldest_first(tmp_path / "ev.jsonl")) >= 3
    await run_sidecar(tmp_path, *rotation, requests=2)
    lines = all_lines(tmp_path / "ev.jsonl")
    opened = [orjson.loads(line) for line in lines if b'"event_type":"infer.evidence_opened"' in line][-1]
    assert (
        opened["resumed_from_seq"] == orjson.loads(first[-1])["seq"]
        and opened["seq"] == opened["resumed_from_seq"] + 1
    )
    assert opened["prev"] == hashlib.sha256(first[-1]).hexdigest()
    code, out = verify(capsys, str(tmp_path / "ev.jsonl"))
    assert code == 0 and "2 writer lives" in out, out
