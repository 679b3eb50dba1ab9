"""An idle sidecar's evidence writer sleeps without a timer (issue 34), and still keeps its bounds:
a record that comes while it sleeps reaches the disk by itself, and the checkpoint the records
are owed is written while no more come (docs/evidence.md). The file is read from disk, not
through `/cache/evidence` (which flushes first)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson

from tests.support.sidecar import stack
from tests.support.sim import fast

CHECKPOINT = "infer.evidence_checkpoint"
OBSERVATION = "infer.cache_observation"
WAIT_S = 10.0  # the bound on each wait for a line; the writer's intervals are a fraction of it


def on_disk(path: Path) -> list[dict[str, Any]]:
    """The whole lines of the evidence file now (none before it exists)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return [orjson.loads(line) for line in data.split(b"\n")[:-1]]


async def wait_for_line(path: Path, event_type: str, after_seq: int = 0) -> dict[str, Any]:
    """The first line of `event_type` past `after_seq` once the writer has put it on disk."""
    async with asyncio.timeout(WAIT_S):
        while True:
            for line in on_disk(path):
                if line["event_type"] == event_type and line["seq"] > after_seq:
                    return line
            await asyncio.sleep(0.05)


async def test_a_record_while_idle_reaches_the_disk_and_its_checkpoint_follows(tmp_path: Path) -> None:
    evidence = tmp_path / "evidence" / "cachewitness.jsonl"
    async with stack(fast("vllm"), tmp_path, checkpoint_interval_s=0.5) as s:
        # The opening is owed a checkpoint, written with no record after it...
        first = await wait_for_line(evidence, CHECKPOINT)
        # ...after which nothing is owed: the writer sleeps until a record comes.
        await asyncio.sleep(0.5)
        assert on_disk(evidence)[-1]["seq"] == first["seq"]
        assert await s.chat(4) == 200
        observation = await wait_for_line(evidence, OBSERVATION, first["seq"])
        # No record follows it: the checkpoint that covers it comes all the same.
        covering = await wait_for_line(evidence, CHECKPOINT, observation["seq"])
        assert covering["counts"] == {OBSERVATION: 1}
