"""The Merkle proofs and signed notes, checked by Go's own transparency-log packages.

scripts/go-check-evidence is a small Go program over golang.org/x/mod/sumdb/note (C2SP signed
notes: `note.Open` with `note.NewEd25519VerifierKey(origin, key)`) and sumdb/tlog (RFC 6962:
`tlog.CheckRecord`, `tlog.CheckTree`), built by scripts/install-go-checker.sh from Debian's
packages. No code of ours checks anything here: Go must accept every checkpoint note, audit path
and consistency proof of a rotated log of two writer lives, and refuse a changed record and a
changed consistency proof. Skips, saying so, where the checker could not be built.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import orjson
import pytest

from proxy.evidence.inclusion import inclusion_lines, scan_lives
from proxy.evidence.keys import SigningKey
from proxy.evidence.reader import evidence_files
from proxy.evidence.writer import EvidenceWriter

CHECKER = Path(__file__).resolve().parents[1] / ".cache" / "tools" / "bin" / "go-check-evidence"


def check(answer: list[bytes], key: SigningKey) -> tuple[int, list[str]]:
    if not CHECKER.exists():
        pytest.skip(f"{CHECKER} not built: scripts/install-go-checker.sh builds it from Debian's Go packages")
    done = subprocess.run(
        [str(CHECKER), key.public.text], input=b"".join(answer), capture_output=True, timeout=60, check=False
    )
    return done.returncode, done.stdout.decode().splitlines()


async def two_lives(path: Path, key: SigningKey) -> None:
    for _life in range(2):
        writer = EvidenceWriter(path, max_bytes=20_000, keep=50, checkpoint_interval_s=3600.0, signer=key)
        await writer.start()
        for n in range(120):
            record = {"schema_version": 1, "event_type": "infer.cache_observation", "at_ns": time.time_ns()}
            writer.write({**record, "session_id": "s" if n % 3 == 0 else "o", "n": n})
            if n % 17 == 16:
                await writer.checkpoint_now()
        await writer.close()


def test_go_accepts_every_note_audit_path_and_consistency_proof(tmp_path: Path) -> None:
    key = SigningKey.generate()
    asyncio.run(two_lives(tmp_path / "ev.jsonl", key))
    files = evidence_files(tmp_path / "ev.jsonl", 50)
    assert len(files) > 2
    answer, trailer = inclusion_lines(
        "ev.jsonl", scan_lives(files, None, lambda r: r.get("session_id") == "s")
    )
    code, said = check(answer, key)
    assert code == 0, said
    kinds = [orjson.loads(line)["event_type"] for line in answer]
    assert trailer["records"] == 80 and trailer["unprovable"] == 0
    assert (
        sum(line.startswith("ok ") and " in tree " in line for line in said)
        == kinds.count("cachewitness.inclusion")
        == 80
    )
    assert sum(" note verified by cachewitness/" in line for line in said) == kinds.count(
        "cachewitness.checkpoint"
    )
    assert (
        sum(" is a prefix of tree " in line for line in said) == kinds.count("cachewitness.consistency") > 10
    )

    entries = [orjson.loads(line) for line in answer]
    first = kinds.index("cachewitness.inclusion")
    entries[first]["line"] = entries[first]["line"].replace('"n":0', '"n":3')
    link = kinds.index("cachewitness.consistency")
    entries[link]["proof"][0] = "00" * 32
    code, said = check([orjson.dumps(e) + b"\n" for e in entries], key)
    assert code == 1
    assert [line.split(":")[0] for line in said if line.startswith("FAIL")] == [
        f"FAIL {first + 1}",
        f"FAIL {link + 1}",
    ]
