"""`cachewitness evidence verify` on hostile bundles: bounded, refused in one line, names escaped.

Each bundle is built here (tests/support/hostile_tar.py) and checked by the real command in a
fresh interpreter, which reports its own peak RSS: a decompression bomb must be refused having
held none of itself (docs/security.md, L3).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import orjson
import pytest

from tests.support.hostile_tar import BLOCK, bomb, tar_with

# Runs the command and prints the interpreter's peak RSS (KiB) on stderr's last line. VmHWM, not
# getrusage's ru_maxrss: Linux carries ru_maxrss across exec from the mm it replaces, which for a
# vfork'd child is its parent's (an xdist worker's few hundred MiB); VmHWM is this mm's own.
_RUN = (
    "import re, sys\n"
    "from proxy.cli import main\n"
    "code = main(['evidence', 'verify', *sys.argv[1:]])\n"
    "status = open('/proc/self/status').read()\n"
    "print('maxrss', re.search(r'VmHWM:\\s*(\\d+)', status).group(1), file=sys.stderr)\n"
    "sys.exit(code)\n"
)
MIB = 1024 * 1024


def verify(*args: Path) -> tuple[int, str, str, int]:
    """Exit code, stdout, stderr (less the RSS line) and peak RSS in MiB of `evidence verify ARGS`."""
    done = subprocess.run(
        [sys.executable, "-c", _RUN, *map(str, args)], capture_output=True, text=True, timeout=120
    )
    *err, rss = done.stderr.rstrip("\n").split("\n")
    assert rss.startswith("maxrss "), done.stderr
    return done.returncode, done.stdout, "\n".join(err), int(rss.split()[1]) // 1024


def test_a_decompression_bomb_is_refused_having_held_none_of_it(tmp_path: Path) -> None:
    """288 MiB of zeros in three members under the per-member bound, 276 KB gzip'd: over the
    256 MiB a bundle may unpack to. Refused in one line, exit 2, peak RSS near the interpreter's
    own (the reader that kept each member till the end held 350 MiB)."""
    path = tmp_path / "bomb.tar.gz"
    size = bomb(path, [(f"pods/p/ev{n}.jsonl", 6 * BLOCK) for n in range(3)])
    assert size < 400_000
    code, out, err, rss = verify(path)
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert "unpacks to more than 268435456 bytes" in line and "Traceback" not in err
    assert rss < 150, f"peak RSS {rss} MiB"


def test_an_oversized_member_is_refused_from_its_header(tmp_path: Path) -> None:
    path = tmp_path / "big.tar.gz"
    bomb(path, [("summary.json", 9 * BLOCK)])
    code, _, err, rss = verify(path)
    assert code == 2
    [line] = err.splitlines()
    assert "member 'summary.json' is 150994944 bytes, over the 134217728 a member may hold" in line
    assert rss < 150, f"peak RSS {rss} MiB"


def _link(name: str, kind: bytes, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize(
    ("member", "says"),
    [
        (("../outside.jsonl", b"x\n"), "absolute or climbing path (path traversal)"),
        (("pods/p/../../../etc/x", b"x\n"), "absolute or climbing path (path traversal)"),
        (("/etc/cachewitness.jsonl", b"x\n"), "absolute or climbing path (path traversal)"),
        (_link("pods/p/ev.jsonl", tarfile.SYMTYPE, "/etc/passwd"), "is a symlink"),
        (_link("pods/p/ev.jsonl", tarfile.LNKTYPE, "summary.json"), "is a hard link"),
        (_link("pods/p/fifo", tarfile.FIFOTYPE, ""), "is not a plain file"),
        (("summary.json", b"{}"), "'summary.json' appears twice"),
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "symlink", "hardlink", "fifo", "duplicate"],
)
def test_a_member_that_is_not_a_plain_file_inside_is_refused(
    tmp_path: Path, member: tarfile.TarInfo | tuple[str, bytes], says: str
) -> None:
    path = tmp_path / "run.tar.gz"
    tar_with(path, [("summary.json", b'{"session_id":"s","pods":[],"cases":[]}'), member])
    code, out, err, _ = verify(path)
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert says in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.tar.gz"]  # nothing written


def test_too_many_members_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "many.tar.gz"
    tar_with(path, [(f"keys/{n}.pem", b"") for n in range(4097)])
    code, _, err, _ = verify(path)
    assert code == 2 and "it holds more than 4096 members" in err


def test_escape_codes_in_a_member_name_cannot_hide_broken(tmp_path: Path) -> None:
    """A chain named `ev<ESC>[2K<CR>…: whole` would, printed raw, erase its own `BROKEN` on a
    terminal: every name is printed with its control characters escaped."""
    name = "ev.jsonl\x1b[2K\rev.jsonl: whole\x1b[8m"
    summary = {"session_id": "s", "pods": [{"pod": "p"}], "cases": []}
    path = tmp_path / "run.tar.gz"
    lines = b"".join(
        orjson.dumps({"event_type": "infer.cache_observation", "seq": n, "prev": "0" * 64}) + b"\n"
        for n in (1, 2)
    )  # the second line's prev is not the first's hash
    tar_with(path, [("summary.json", orjson.dumps(summary)), (f"pods/p/{name}", lines)])
    code, out, _, _ = verify(path)
    assert code == 1
    assert "\x1b" not in out and "\r" not in out
    assert "pods/p/ev.jsonl\\x1b[2K\\x0dev.jsonl: whole\\x1b[8m: BROKEN" in out


def proof_bundle(tmp_path: Path) -> tuple[Path, list[dict[str, object]], dict[str, object]]:
    """A real bundle of one small signed log (the sidecar's writer and prover, no sidecar): its
    path, its proof's entries and its summary."""
    import asyncio
    import time

    from proxy.evidence.bundle import cases_of, proven_records, write_bundle
    from proxy.evidence.inclusion import inclusion_lines, scan_lives
    from proxy.evidence.keys import SigningKey
    from proxy.evidence.writer import EvidenceWriter

    key = SigningKey.generate()

    async def write() -> None:
        writer = EvidenceWriter(tmp_path / "ev.jsonl", checkpoint_interval_s=3600.0, signer=key)
        await writer.start()
        for n in range(6):
            writer.write(
                {
                    "schema_version": 1,
                    "event_type": "infer.cache_observation",
                    "at_ns": time.time_ns(),
                    "session_id": "s",
                }
            )
            if n % 2:
                await writer.checkpoint_now()
        await writer.close()

    asyncio.run(write())
    lines, _ = inclusion_lines(
        "ev.jsonl", scan_lives([tmp_path / "ev.jsonl"], None, lambda r: r.get("session_id") == "s")
    )
    pods = {"p": proven_records(lines)}
    summary: dict[str, object] = {"session_id": "s", "pods": [{"pod": "p"}], "cases": cases_of(pods, "s")}
    path = tmp_path / "run.tar.gz"
    write_bundle(path, summary, [key.public], {"p": lines})
    return path, [orjson.loads(line) for line in lines], summary


def _set(
    entries: list[dict[str, object]], kind: str, field: str, value: object
) -> tuple[list[dict[str, object]], int]:
    number = next(i for i, e in enumerate(entries) if e["event_type"] == kind)
    changed = [dict(e) for e in entries]
    changed[number][field] = value
    return changed, number + 1


def verify_here(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, str, str]:
    """`evidence verify PATH` in this process: exit code, stdout, stderr."""
    from proxy.cli import main

    code = main(["evidence", "verify", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("kind", "field", "value", "says"),
    [
        (
            "cachewitness.inclusion",
            "tree_size",
            1,
            "a malformed proof: leaf_index 1, tree_size 1 (its checkpoint's is",
        ),
        ("cachewitness.inclusion", "leaf_index", "1", "a malformed proof: leaf_index '1'"),
        (
            "cachewitness.inclusion",
            "audit_path",
            ["zz" * 32],
            "audit_path of something else than at most 64 hex",
        ),
        (
            "cachewitness.inclusion",
            "audit_path",
            ["00" * 32] * 65,
            "audit_path of something else than at most 64 hex",
        ),
        ("cachewitness.consistency", "to_size", 99, "a malformed consistency proof"),
        ("cachewitness.consistency", "proof", "00", "a malformed consistency proof: not at most 64 hex"),
        ("not json", "", None, "not a JSON object"),
    ],
    ids=[
        "wrong-size",
        "index-not-int",
        "not-hex",
        "path-too-long",
        "consistency-size",
        "consistency-hashes",
        "not-json",
    ],
)
def test_a_malformed_proof_is_refused_in_one_line(
    tmp_path: Path, kind: str, field: str, value: object, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sizes, indexes or hashes that are not a proof's: bad input (exit 2, one line naming the
    answer's line), never a traceback nor a verdict on the records."""
    path, entries, summary = proof_bundle(tmp_path)
    code, out, err = verify_here(capsys, path)
    assert code == 0 and ": proven: " in out, out + err
    if kind == "not json":
        body, number = b"".join(orjson.dumps(e) + b"\n" for e in entries) + b"[1, 2]\n", len(entries) + 1
    else:
        changed, number = _set(entries, kind, field, value)
        body = b"".join(orjson.dumps(e) + b"\n" for e in changed)
    tar_with(path, [("summary.json", orjson.dumps(summary)), ("proofs/p.jsonl", body)])
    code, out, err = verify_here(capsys, path)
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert f"{path}: proofs/p.jsonl:{number}: " in line and says in line, line
