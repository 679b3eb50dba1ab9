"""Verifying a large evidence log, and what a Merkle proof of one record costs.

    .venv/bin/python bench/verify_merkle_cost.py [--records 100000] [--session-records 100]

Writes a signed log of `--records` observation records (~650 bytes each, as the simulator's) with
the sidecar's own writer, a checkpoint every 1,000 records, `--session-records` of them in session
`proven` spread evenly, then times, best of three:

- `cachewitness evidence verify FILE --public-key K` in a fresh interpreter: every link, count,
  signature, and each writer life's Merkle tree rebuilt and checked against every checkpoint;
- the sidecar's `?proof=inclusion&session_id=proven` work (one pass over the files: every line
  hashed as a leaf; the paths) in this process;
- checking that answer (every audit path, signature and consistency proof), as `verify` does in
  a bundle;

and prints the sizes: the log, the answer, the hashes in one audit path (O(log n)).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson
from evidence_chain_cost import RECORD  # one record shape for the evidence benches

from proxy.evidence.inclusion import inclusion_lines, scan_lives
from proxy.evidence.keys import SigningKey
from proxy.evidence.proof_check import ProofCheck
from proxy.evidence.reader import record_matches
from proxy.evidence.writer import EvidenceWriter


async def write_log(path: Path, key: SigningKey, records: int, session_records: int) -> None:
    """The log, written by the sidecar's writer (no rotation: one file, one writer life)."""
    writer = EvidenceWriter(path, max_bytes=1 << 40, checkpoint_interval_s=3600.0, signer=key)
    await writer.start()
    every = max(1, records // max(1, session_records))
    now = time.time_ns()
    for n in range(records):
        session = "proven" if n % every == every // 2 else "bench-session"
        writer.write({**RECORD, "at_ns": now + n, "session_id": session, "started_ns": now + n})
        if n % 1000 == 999:
            await writer.checkpoint_now()
    await writer.close()


def best(repeat: int, run: Callable[[], object]) -> tuple[float, object]:
    """The fastest of `repeat` runs, in seconds, and the last result."""
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - started)
    return min(times), result


def main() -> None:
    """Write the log, time the three steps, print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--session-records", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path, key = Path(folder) / "ev.jsonl", SigningKey.generate()
        (Path(folder) / "key.pem").write_bytes(key.pem())
        asyncio.run(write_log(path, key, ns.records, ns.session_records))
        command = [
            sys.executable,
            "-m",
            "proxy",
            "evidence",
            "verify",
            str(path),
            "--public-key",
            str(Path(folder) / "key.pem"),
        ]
        verify_s, done = best(
            ns.repeat,
            lambda: subprocess.run(
                command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]
            ),
        )
        assert isinstance(done, subprocess.CompletedProcess) and done.returncode == 0, done
        matches = functools.partial(record_matches, session_id="proven")
        prove_s, answer = best(
            ns.repeat, lambda: inclusion_lines("ev.jsonl", scan_lives([path], None, matches))[0]
        )
        assert isinstance(answer, list)

        def check() -> object:
            proof = ProofCheck("answer")
            for number, line in enumerate(answer, 1):
                proof.feed(line, number)
            return proof.finish()

        check_s, report = best(ns.repeat, check)
        assert getattr(report, "whole", False), report
        paths = [
            len(orjson.loads(line)["audit_path"])
            for line in answer
            if line.startswith(b'{"event_type":"cachewitness.inclusion"')
        ]
        size = path.stat().st_size
        print(
            f"log: {ns.records:,} records, {size / 1e6:.1f} MB, one writer life, a checkpoint every 1,000 records\n"
        )
        print(f"| step | seconds (best of {ns.repeat}) |")
        print("|---|---|")
        print(
            f"| `evidence verify` the whole file (chain, counts, signatures, trees), fresh interpreter | {verify_s:.2f} |"
        )
        print(
            f"| `?proof=inclusion` for {len(paths)} records (one pass: every line a leaf; the paths) | {prove_s:.2f} |"
        )
        print(f"| checking that answer (audit paths, signatures, consistency) | {check_s:.3f} |")
        print(
            f"\nanswer: {sum(map(len, answer)):,} bytes for {len(paths)} records; hashes per audit path: {min(paths)}-{max(paths)} (log2 of the tree size)"
        )


if __name__ == "__main__":
    main()
