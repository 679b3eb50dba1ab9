"""The evidence as two files: the observations, and the reset records that traffic cannot rotate away.

Every `infer.cache_state` record (pod and cluster resets, slot erases) and every
`infer.cache_verification` goes to `evidence_resets_path`, rotated by its own size and keep;
everything else to `evidence`. Only an admin call, or the verdict that follows one, writes a
reset record, so clients flooding the sidecar rotate the observation file and never the resets.
`GET /cache/evidence` reads both merged by `at_ns`: one stream, as before the split.

The resets file also keeps what an open case needs of the observations (proxy/recorder.py:
the request that settled its verdict, and its first own requests, those with its case token),
and says each file a rotation dropped, in either file (`infer.evidence_rotated`: which file,
its bytes, the seq and at_ns of its first and last lines), so history never goes silently.

Records of requests the sidecar refused itself (400, 413, 503: no engine work, so the cheapest
to send) are also bounded in rate, `evidence_rejected_per_s`; those past it are counted in
`evidence_dropped_total{reason="rate"}`, never written.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.config import SETTINGS
from proxy.evidence.inclusion import ConsistencyError, consistency_answer, inclusion_lines, scan_lives
from proxy.evidence.keys import load_signing_key
from proxy.evidence.merge import read_merged
from proxy.evidence.proof import proof_stream, proof_trailer
from proxy.evidence.reader import evidence_files, record_matches
from proxy.evidence.writer import DropReason, EvidenceWriter
from proxy.vocabulary import EventType

__all__ = ["EVIDENCE", "RESET_EVENTS", "EvidenceLog", "RateBound", "setup_evidence"]

# Records a flood of observations must not rotate away: resets, verdicts, the index at case starts,
# the counter witness's reconciliations and the engine's events.
RESET_EVENTS = frozenset(
    {
        "infer.cache_state",
        "infer.cache_verification",
        "infer.cache_blocks",
        "infer.cache_reconciliation",
        "infer.engine_event",
        "infer.evidence_rotated",
    }
)
# Reset records waiting for a full disk, at most (and at most evidence_queue_max_bytes): they
# are few and small (only admin calls write them), so this adds little to the observations' bound.
_RESETS_QUEUE_BYTES = 4 * 1024 * 1024


class RateBound:
    """A token bucket: `rate` a second on average, bursts of one second's worth; 0 = no bound."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        """Start full."""
        self.rate = rate
        self._burst = max(rate, 1.0)
        self._tokens = self._burst
        self._clock = clock
        self._at = clock()

    def take(self) -> bool:
        """Whether one more event fits now (and count it)."""
        if self.rate <= 0:
            return True
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class EvidenceLog:
    """Both evidence writers behind one `write`: each record to its file, counters summed over both."""

    def __init__(
        self, observations: EvidenceWriter, resets: EvidenceWriter, *, rejected_per_s: float
    ) -> None:
        """Route to the two writers; refused requests' records bounded to `rejected_per_s`."""
        self.observations = observations
        self.resets = resets
        self._rejected = RateBound(rejected_per_s)
        self._writers = (observations, resets)
        for writer in self._writers:
            writer.on_rotated = partial(self._rotated, writer)

    def _rotated(self, writer: EvidenceWriter, note: dict[str, Any]) -> None:
        """A rotation dropped one of `writer`'s files: the resets file says what history went."""
        self.resets.write(
            {
                "schema_version": 1,
                "event_type": str(EventType.EVIDENCE_ROTATED),
                "at_ns": time.time_ns(),
                "file": writer.path.name,
                "max_bytes": writer.max_bytes,
                "keep": writer.keep,
                **note,
            }
        )

    def write(self, record: dict[str, Any]) -> None:
        """Enqueue one record in its file; never blocks, never raises."""
        self._file_of(record.get("event_type")).write(record)

    def write_later(
        self, event_type: str, build: Callable[[], dict[str, Any]], *, keep: bool = False
    ) -> None:
        """Enqueue one record in its file, built at the flush (EvidenceWriter.write_later); `keep`:
        in the resets file whatever its type (an observation an open case needs, proxy/recorder.py)."""
        writer = self.resets if keep else self._file_of(event_type)
        writer.write_later(event_type, build)

    def _file_of(self, event_type: object) -> EvidenceWriter:
        """The writer of the file a record of this type goes to."""
        return self.resets if event_type in RESET_EVENTS else self.observations

    def write_rejected(self, record: dict[str, Any]) -> None:
        """The record of a request the sidecar refused itself, within the rate bound (else counted)."""
        if self._rejected.take():
            self.observations.write(record)
        else:
            self.observations.drop(DropReason.RATE, str(record.get("event_type", "unknown")))

    async def start(self) -> None:
        """Start both flush tasks."""
        for writer in self._writers:
            await writer.start()

    async def flush(self) -> None:
        """Write every record queued so far, in both files."""
        for writer in self._writers:
            await writer.flush()

    async def close(self) -> None:
        """Flush, fsync and close both files."""
        for writer in self._writers:
            await writer.close()

    @property
    def records_total(self) -> dict[str, int]:
        """Records written, by event type, both files."""
        total: dict[str, int] = {}
        for writer in self._writers:
            # A copy: the writer's thread adds keys (dict() copies atomically under the GIL).
            for event_type, count in dict(writer.records_total).items():
                total[event_type] = total.get(event_type, 0) + count
        return total

    @property
    def dropped(self) -> dict[DropReason, int]:
        """Records that will never be written, by reason, both files."""
        return {reason: sum(w.dropped[reason] for w in self._writers) for reason in DropReason}

    @property
    def dropped_total(self) -> int:
        """Records that will never be written, all reasons."""
        return sum(w.dropped_total for w in self._writers)

    @property
    def write_errors_total(self) -> int:
        """Writes the disk refused, both files."""
        return sum(w.write_errors_total for w in self._writers)

    @property
    def pending_bytes(self) -> int:
        """Bytes written to no file yet, both files."""
        return sum(w.pending_bytes for w in self._writers)

    def chain_names(self) -> list[str]:
        """Each file's name in a proof: its file name (both in one folder by default), told apart if equal."""
        names = [w.path.name for w in self._writers]
        return names if len(set(names)) == len(names) else [f"{i}-{n}" for i, n in enumerate(names)]

    async def proof(self, **filters: Any) -> AsyncGenerator[bytes, None]:
        """The chain segments that prove the matching records, checkpointed now (proxy/evidence/proof.py)."""
        marks = [await writer.checkpoint_now() for writer in self._writers]
        chains = [
            (name, evidence_files(w.path, w.keep), mark)
            for name, w, mark in zip(self.chain_names(), self._writers, marks, strict=True)
        ]
        async with aclosing(proof_stream(chains, filters)) as stream:
            async for data in stream:
                yield data

    async def inclusion(self, **filters: Any) -> AsyncGenerator[bytes, None]:
        """`?proof=inclusion`: each matching record with its audit path to a signed checkpoint,
        checkpointed now (proxy/evidence/inclusion.py)."""
        marks = [await writer.checkpoint_now() for writer in self._writers]
        matches = functools.partial(record_matches, **filters)
        chains = []
        for name, writer, mark in zip(self.chain_names(), self._writers, marks, strict=True):
            files = evidence_files(writer.path, writer.keep)
            lives = await asyncio.to_thread(scan_lives, files, mark, matches)
            lines, entry = await asyncio.to_thread(inclusion_lines, name, lives)
            chains.append(entry)
            yield b"".join(lines)
        yield proof_trailer(chains)

    async def consistency(self, file: str | None, first: int, second: int) -> dict[str, Any]:
        """`?proof=consistency&from=S1&to=S2[&file=F]`: ConsistencyError when it cannot be given."""
        names = self.chain_names()
        if file is None:
            file = names[0]
        if file not in names:
            raise ConsistencyError(f"file must be one of {', '.join(names)}")
        writer = self._writers[names.index(file)]
        await writer.flush()
        lives = await asyncio.to_thread(
            scan_lives, evidence_files(writer.path, writer.keep), None, lambda _record: False
        )
        return await asyncio.to_thread(consistency_answer, file, lives, first, second)

    def read(self, **filters: Any) -> AsyncIterator[list[bytes]]:
        """The matching lines of both files, in blocks (see `read_merged`)."""
        sources = [(w.path, w.keep) for w in self._writers]
        return read_merged(sources, **filters)


EVIDENCE = web.AppKey("evidence", EvidenceLog)


def setup_evidence(app: web.Application) -> None:
    """The evidence writers: started first, closed (flushed, fsync'd) after everything that records."""
    settings = app[SETTINGS]
    # A bad key file is refused before the server starts (proxy/serve.py): here it loads.
    signer = (
        load_signing_key(settings.evidence_signing_key_file) if settings.evidence_signing_key_file else None
    )
    observations = EvidenceWriter(
        Path(settings.evidence),
        max_bytes=settings.evidence_max_bytes,
        keep=settings.evidence_keep,
        stdout=settings.evidence_stdout,
        max_queue_bytes=settings.evidence_queue_max_bytes,
        checkpoint_interval_s=settings.checkpoint_interval_s,
        signer=signer,
    )
    resets = EvidenceWriter(
        Path(settings.resets_evidence),
        max_bytes=settings.evidence_resets_max_bytes,
        keep=settings.evidence_resets_keep,
        stdout=settings.evidence_stdout,
        max_queue_bytes=min(settings.evidence_queue_max_bytes, _RESETS_QUEUE_BYTES),
        checkpoint_interval_s=settings.checkpoint_interval_s,
        signer=signer,
    )
    log = EvidenceLog(observations, resets, rejected_per_s=settings.evidence_rejected_per_s)
    app[EVIDENCE] = log

    async def lifetime(_app: web.Application) -> AsyncIterator[None]:
        await log.start()
        yield
        await log.close()

    app.cleanup_ctx.append(lifetime)
