"""The evidence writer's CPU per record before and after the hash chain, and a signed checkpoint's cost.

    .venv/bin/python bench/evidence_chain_cost.py [--records 50000] [--batch 1024] [--repeat 5]

The chain is built in the writer's thread, never on the request path (`write()` only encodes
and queues, as before). So the figure is that thread's CPU time (`time.thread_time`) per record
for one batch of `--batch` observation records written to a file in a temporary directory:

- before: the write alone (`RotatingFile.write_batch` of the encoded lines, as the writer did
  without a chain);
- after: the chain (seq, and prev = SHA-256 of the line before, proxy/evidence/chain.py) and the
  same write (`_chain_and_write`, what the writer's thread now runs);
- the chain alone, and one Ed25519-signed checkpoint, amortised over the records one
  `checkpoint_interval_s` (10 s) covers at several request rates.

Best of `--repeat` runs of each. The goal (issue 31): ≤ 5 µs per record for the chain.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from proxy.evidence.chain import ZERO_HASH, Chain, Predecessor
from proxy.evidence.keys import SigningKey
from proxy.evidence.lines import encode_record
from proxy.evidence.rotating import RotatingFile
from proxy.evidence.writer import EvidenceWriter

# A real observation record's shape (a chat completion through the simulator), ~600 bytes.
RECORD = {
    "schema_version": 1,
    "event_type": "infer.cache_observation",
    "request_id": "1f954fc7365c794c93446a58760e5fde",
    "session_id": "bench-session",
    "case_id": "case-0001",
    "method": "POST",
    "path": "/v1/chat/completions",
    "status": 200,
    "stream": True,
    "model": "sim-model",
    "prompt_tokens": 812,
    "completion_tokens": 64,
    "cached_tokens": 768,
    "cached_tokens_source": "usage.prompt_tokens_details.cached_tokens",
    "reset_id": "0f4c2a7e9b1d4e7f8a6c3b2d1e0f9a8b",
    "ordinal_since_reset": 3,
    "outcome": "ok",
    "usage_injected": True,
    "engine_request_id": "chatcmpl-7f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c",
}


def _lines(count: int) -> list[tuple[str, bytes, int]]:
    """`count` encoded records, each with its own times, as `write()` queues them."""
    now = time.time_ns()
    out: list[tuple[str, bytes, int]] = []
    for n in range(count):
        record = {**RECORD, "at_ns": now + n, "started_ns": now + n - 900_000, "finished_ns": now + n}
        line = encode_record(record)
        assert line is not None
        out.append(("infer.cache_observation", line, 0))
    return out


def _cpu_us_per_record(run: Callable[[], object], records: int, repeat: int) -> float:
    """The best of `repeat` runs, in µs of this thread's CPU per record."""
    best = float("inf")
    for _ in range(repeat):
        start = time.thread_time()
        run()
        best = min(best, time.thread_time() - start)
    return best / records * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=50_000, help="records per run (default 50000)")
    parser.add_argument("--batch", type=int, default=1024, help="records per flush (default 1024)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each, the best counts (default 5)")
    args = parser.parse_args(argv)
    queued = _lines(args.records)
    batches = [queued[i : i + args.batch] for i in range(0, len(queued), args.batch)]
    key = SigningKey.generate()
    with tempfile.TemporaryDirectory(prefix="cw-chain-") as folder:

        def writer(name: str) -> EvidenceWriter:
            # Rotation at 64 MiB as by default; each run its own file.
            return EvidenceWriter(Path(folder) / name, keep=0)

        def before() -> None:
            plain = RotatingFile(
                Path(folder) / f"before-{time.monotonic_ns()}.jsonl", max_bytes=64 << 20, keep=0, stdout=False
            )
            for batch in batches:
                plain.write_batch([(kind, line) for kind, line, _ in batch])
            plain.close(sync=False)

        def after() -> None:
            chained = writer(f"after-{time.monotonic_ns()}.jsonl")
            for batch in batches:
                chained._chain_and_write([], batch)
            chained._file.close(sync=False)

        def chain_alone() -> None:
            chain = Chain(Predecessor(0, ZERO_HASH, False), writer_id="bench", signer=None)
            for kind, line, gap in queued:
                chain.link(line, kind, gap)

        before_us = _cpu_us_per_record(before, args.records, args.repeat)
        after_us = _cpu_us_per_record(after, args.records, args.repeat)
        chain_us = _cpu_us_per_record(chain_alone, args.records, args.repeat)
    signing = Chain(Predecessor(0, ZERO_HASH, False), writer_id="bench", signer=key)
    signing.counts = {"infer.cache_observation": 10_000, "infer.cache_state": 2}
    checkpoint_us = _cpu_us_per_record(
        lambda: signing.checkpoint(at_ns=time.time_ns(), final=False), 1, max(args.repeat, 50)
    )
    line = len(queued[0][1])
    print(
        f"{args.records} observation records of {line} bytes, batches of {args.batch}, best of {args.repeat}"
    )
    print(f"{'writer thread CPU per record':<44} {'µs':>8}")
    print(f"{'before (write only, no chain)':<44} {before_us:>8.2f}")
    print(f"{'after (chain + write)':<44} {after_us:>8.2f}")
    print(f"{'the chain alone (seq, prev = SHA-256)':<44} {chain_us:>8.2f}")
    print(f"{'after - before':<44} {after_us - before_us:>8.2f}")
    print(f"one signed checkpoint (Ed25519): {checkpoint_us:.0f} µs; per record at a 10 s interval:")
    for rate in (10, 100, 1000, 10_000):
        print(f"  {rate:>6} records/s: {checkpoint_us / (rate * 10):>8.3f} µs")
    goal = chain_us <= 5.0
    print(f"goal ≤ 5 µs per record for the chain: {'met' if goal else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
