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

# Runs the command and prints the interpreter's peak RSS (KiB) on stderr's last line.
_RUN = (
    "import resource, sys\n"
    "from proxy.cli import main\n"
    "code = main(['evidence', 'verify', *sys.argv[1:]])\n"
    "print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
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
