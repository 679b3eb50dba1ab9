"""Mutation audit: plant one bug at a time, run the tests, restore, say which bugs the suite let through.

Each mutant in a TOML file (default scripts/mutants.toml) names a file, a snippet that must occur in it
exactly once, its replacement and the tests nearest to it:

    [[mutant]]
    id = "front-head-limit"
    file = "proxy/inbound/head.py"
    find = "if len(head) > limit:"
    replace = "if len(head) > limit * 4:"
    tests = ["tests/test_front.py"]
    why = "the head limit checked four times too late"

For each mutant the driver checks the file's SHA-256, plants the bug, runs the related tests and, when
they pass, the fast suite; restores the file from the bytes it read and checks the hash again (a
mismatch stops the run: the tree would be left changed). A mutant is *killed* when a run fails, a
*survivor* when both pass. The table goes to stdout (Markdown), one row per mutant.

    python scripts/mutate.py                      # every mutant
    python scripts/mutate.py --only front-head-limit --no-suite
"""

from __future__ import annotations

import argparse
import hashlib
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST_SUITE = [
    "-m",
    "not real and not soak and not slow",
    "--ignore=tests/test_helm.py",
    "--ignore=tests/test_helm_cluster.py",
    "--ignore=tests/real",
]
# One run of the related tests or of the fast suite; a mutant that hangs them is a kill (by timeout).
RUN_LIMIT_S = 900


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    verdict: str  # "killed by related (test)" | "killed by suite (test)" | "survived" | "not applied: ..."
    seconds: float


def load(path: Path) -> list[Mutant]:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return [
        Mutant(m["id"], m["file"], m["find"], m["replace"], tuple(m.get("tests", [])), m.get("why", ""))
        for m in data["mutant"]
    ]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pytest(args: list[str], workers: str) -> str | None:
    """None when the tests passed, else the first test that failed (or why the run stopped)."""
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", workers, *args]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, timeout=RUN_LIMIT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"over {RUN_LIMIT_S} s"
    if done.returncode == 0:
        return None
    # A kill names its test: a flaky failure under load is then told from the bug's.
    for line in done.stdout.decode(errors="replace").splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0]
    return f"exit {done.returncode}"


def run_one(mutant: Mutant, suite: bool, workers: str) -> Outcome:
    started = time.monotonic()
    target = ROOT / mutant.file
    original = target.read_bytes()
    before = _digest(original)
    text = original.decode("utf-8")
    count = text.count(mutant.find)
    if count != 1:
        return Outcome(mutant, f"not applied: snippet found {count} times", 0.0)
    target.write_bytes(text.replace(mutant.find, mutant.replace).encode("utf-8"))
    try:
        failed = _pytest(list(mutant.tests), "0") if mutant.tests else None
        if failed is not None:
            verdict = f"killed by related ({failed})"
        elif suite and (failed := _pytest(FAST_SUITE, workers)) is not None:
            verdict = f"killed by suite ({failed})"
        else:
            verdict = "survived"
    finally:
        target.write_bytes(original)
    if _digest(target.read_bytes()) != before:
        raise SystemExit(f"mutate: {mutant.file} not restored (hash differs): stop and check the tree")
    return Outcome(mutant, verdict, time.monotonic() - started)


def table(outcomes: list[Outcome]) -> str:
    lines = ["| mutant | file | bug | verdict | s |", "|---|---|---|---|---:|"]
    for o in outcomes:
        m = o.mutant
        lines.append(f"| {m.id} | {m.file} | {m.why} | {o.verdict} | {o.seconds:.0f} |")
    applied = [o for o in outcomes if not o.verdict.startswith("not applied")]
    killed = sum(o.verdict.startswith("killed") for o in applied)
    lines.append("")
    lines.append(f"killed {killed} of {len(applied)} applied ({len(outcomes) - len(applied)} not applied)")
    return "\n".join(lines)


def _stop(signum: int, _frame: object) -> None:
    """SIGTERM as Ctrl-C: the planted file is restored by run_one's `finally` before the exit."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _stop)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mutants", type=Path, default=ROOT / "scripts" / "mutants.toml")
    parser.add_argument("--only", action="append", default=[], help="run this mutant id (repeatable)")
    parser.add_argument("--no-suite", action="store_true", help="related tests only")
    parser.add_argument("--workers", default="auto", help="pytest-xdist workers for the fast suite")
    args = parser.parse_args(argv)
    mutants = load(args.mutants)
    if args.only:
        mutants = [m for m in mutants if m.id in set(args.only)]
    outcomes = []
    for mutant in mutants:
        outcome = run_one(mutant, not args.no_suite, args.workers)
        print(f"{mutant.id}: {outcome.verdict} ({outcome.seconds:.0f} s)", file=sys.stderr, flush=True)
        outcomes.append(outcome)
    print(table(outcomes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
