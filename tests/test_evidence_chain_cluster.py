"""A 3-pod cluster's run bundle, checked offline; and each pod's chain checked by a scope=cluster read.

Each pod is a simulator and a sidecar on 127.0.0.(i+1) (tests/cluster_helpers.py). The bundle
command runs in a thread (it is a blocking client; the pods serve on this test's loop).
"""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path

import orjson
import pytest

from proxy.cli import main
from proxy.evidence.bundle import safe_name
from tests.support.cluster import Cluster, Pod, cluster
from tests.support.sim import chat, fast

SESSION = "paper-run"


async def run_session(c: Cluster) -> str:
    """A cluster reset for the session, then two chats on every pod; the reset's id."""
    status, body = await c.reset({"scope": "cluster", "session_id": SESSION, "verify": "none"}, query="")
    assert status == 200, body
    for round_ in range(2):
        for index, pod in enumerate(c.pods):
            async with c.http.post(
                f"{pod.url}/v1/chat/completions",
                json=chat(f"round {round_} pod {index}"),
                headers={"X-Session-Id": SESSION},
            ) as resp:
                assert resp.status == 200
                await resp.read()
    return str(body["reset_id"])


async def bundle(c: Cluster, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`cachewitness evidence bundle --scope cluster` through the first pod."""
    args = ["evidence", "bundle", "--url", c.pods[0].url, "--session-id", SESSION, "--scope", "cluster"]
    code = await asyncio.to_thread(main, [*args, "-o", str(out)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def verify(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["evidence", "verify", str(path)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def edit_a_session_line(pod: Pod) -> None:
    """Change one byte of one of the pod's session observations on disk, in place (same length)."""
    data = pod.evidence.read_bytes()
    start = data.index(b'"session_id":"' + SESSION.encode())
    offset = data.index(b'"prompt_tokens":', start) + len(b'"prompt_tokens":')
    digit = data[offset : offset + 1]
    assert digit.isdigit()
    with open(pod.evidence, "r+b") as handle:
        handle.seek(offset)
        handle.write(b"9" if digit != b"9" else b"8")


def members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]  # a file member always has a reader


def rewrite(path: Path, name: str, data: bytes) -> None:
    """The bundle with one member's bytes replaced."""
    files = members(path)
    files[name] = data
    with tarfile.open(path, "w:gz") as tar:
        for member, body in files.items():
            info = tarfile.TarInfo(member)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))


async def test_a_cluster_bundle_verifies_offline_and_fails_once_edited(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every pod's proof in the bundle, each record proven; summary.json has each pod's case; an
    edited byte of one pod's record, or an edited verdict in the summary, is found offline."""
    async with cluster(tmp_path, [fast("vllm")] * 3, checkpoint_interval_s=0.2) as c:
        await run_session(c)
        out = tmp_path / "run.tar.gz"
        code, printed = await bundle(c, out, capsys)
    assert code == 0, printed
    files = members(out)
    summary = orjson.loads(files["summary.json"])
    assert sorted(p["pod"] for p in summary["pods"]) == sorted(pod.address for pod in c.pods)
    assert sorted(c["pod"] for c in summary["cases"]) == sorted(pod.address for pod in c.pods)
    assert all(case["requests"] == 2 and case["reset_answer"] == "acknowledged" for case in summary["cases"])
    for pod in c.pods:
        proven = [orjson.loads(line) for line in files[f"proofs/{safe_name(pod.address)}.jsonl"].splitlines()]
        files_proven = {e["file"] for e in proven if e["event_type"] == "cachewitness.inclusion"}
        assert files_proven == {"cachewitness.jsonl", "cachewitness.resets.jsonl"}
    assert printed.count(": proven: ") == 3 and "BROKEN" not in printed
    assert verify(out, capsys)[0] == 0

    name = f"proofs/{safe_name(c.pods[1].address)}.jsonl"
    lines = files[name].splitlines(keepends=True)
    number = next(
        i
        for i, line in enumerate(lines, 1)
        if line.startswith(b'{"event_type":"cachewitness.inclusion"') and b"infer.cache_observation" in line
    )
    entry = orjson.loads(lines[number - 1])
    edited = entry["line"].replace('"stream":false', '"stream":true')
    assert edited != entry["line"]
    entry["line"] = edited
    seq = orjson.loads(entry["line"])["seq"]
    rewrite(out, name, b"".join([*lines[: number - 1], orjson.dumps(entry) + b"\n", *lines[number:]]))
    code, printed = verify(out, capsys)
    assert (
        code == 1
        and f"{name}:{number}: cachewitness.jsonl seq {seq}: its audit path does not lead" in printed
    )

    rewrite(out, name, files[name])
    summary["cases"][0]["reset_answer"] = "refused"
    rewrite(out, "summary.json", orjson.dumps(summary))
    code, printed = verify(out, capsys)
    assert code == 1 and "summary.json: its cases are not what the bundle's records say" in printed


async def test_a_pod_whose_file_was_edited_is_named_by_the_cluster_read_and_the_bundle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One pod's evidence edited on disk: the merged read names it in broken_chains (the two
    others verified), and a bundle made then is written but exits 1 naming it."""
    async with cluster(tmp_path, [fast("vllm")] * 3, checkpoint_interval_s=0.2) as c:
        await run_session(c)
        status, raw = await c.get(f"/cache/evidence?scope=cluster&session_id={SESSION}")
        assert status == 200
        trailer = orjson.loads(raw.splitlines()[-1])
        assert sorted(trailer["chains_verified"]) == sorted(pod.address for pod in c.pods)
        assert trailer["broken_chains"] == []
        edit_a_session_line(c.pods[2])
        status, raw = await c.get(f"/cache/evidence?scope=cluster&session_id={SESSION}", via=1)
        assert status == 200
        *records, trailer = [orjson.loads(line) for line in raw.splitlines()]
        out = tmp_path / "run.tar.gz"
        code, printed = await bundle(c, out, capsys)
    assert len([r for r in records if r["event_type"] == "infer.cache_observation"]) == 6
    assert sorted(trailer["chains_verified"]) == sorted(pod.address for pod in c.pods[:2])
    (broken,) = trailer["broken_chains"]
    assert (broken["pod"], broken["file"]) == (c.pods[2].address, "cachewitness.jsonl")
    assert "prev is not the hash of the line before it" in broken["problems"][0]
    assert code == 1 and out.exists()
    safe = safe_name(c.pods[2].address)
    assert f"proofs/{safe}.jsonl: BROKEN" in printed and printed.count(": proven: ") == 2
    assert "its audit path does not lead to the root of checkpoint seq" in printed
