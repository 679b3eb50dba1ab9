"""A hostile run bundle against `cachewitness evidence verify`: peak RSS and time, per checkout.

    .venv/bin/python bench/bundle_bomb.py [--members 5] [--member-mib 1008] [--checkout /path/to/other]

Builds a decompression bomb (tests/support/hostile_tar.py: members of zeros, each under the old
1 GiB per-member bound) and runs `evidence verify` on it in a fresh interpreter of this checkout
and of each `--checkout` given (its own `.venv`), printing a table of exit code, peak RSS and seconds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.hostile_tar import BLOCK, bomb

# VmHWM: the child's own peak (ru_maxrss carries its parent's across exec; see the hostile-bundle tests).
_RUN = (
    "import re, sys\n"
    "from proxy.cli import main\n"
    "code = main(['evidence', 'verify', sys.argv[1]])\n"
    "status = open('/proc/self/status').read()\n"
    "print('maxrss', re.search(r'VmHWM:\\s*(\\d+)', status).group(1), file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def run(checkout: Path, path: Path) -> tuple[int, int, float, str]:
    """Exit code, peak RSS (MiB), seconds and the first line printed, of verify in `checkout`."""
    started = time.monotonic()
    done = subprocess.run(
        [str(checkout / ".venv/bin/python"), "-c", _RUN, str(path)],
        capture_output=True,
        text=True,
        cwd=checkout,
        timeout=1800,
    )
    seconds = time.monotonic() - started
    *said, rss = done.stderr.rstrip("\n").split("\n")
    return done.returncode, int(rss.split()[1]) // 1024, seconds, (said or [done.stdout])[0][:90]


def main() -> None:
    """Build the bomb, run each checkout on it, print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--members", type=int, default=5)
    parser.add_argument("--member-mib", type=int, default=1008, help="a multiple of 16")
    parser.add_argument("--checkout", action="append", default=[], type=Path, help="another checkout to run")
    ns = parser.parse_args()
    checkouts = [Path(__file__).resolve().parents[1], *ns.checkout]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "bomb.tar.gz"
        size = ns.member_mib * 1024 * 1024 // BLOCK * BLOCK
        on_disk = bomb(path, [(f"pods/p/ev{n}.jsonl", size) for n in range(ns.members)])
        print(
            f"bomb: {on_disk / 1e6:.1f} MB gzip'd, {ns.members * size / 2**30:.2f} GiB unpacked, {ns.members} members\n"
        )
        print("| checkout | exit | peak RSS MiB | seconds | said |")
        print("|---|---|---|---|---|")
        for checkout in checkouts:
            code, rss, seconds, said = run(checkout, path)
            print(f"| {checkout} | {code} | {rss} | {seconds:.1f} | {said} |")


if __name__ == "__main__":
    main()
