"""A full evidence disk shows in the chain as declared gaps, on `python -m proxy serve` with a 64 KiB tmpfs.

Records the queue bound drops while the disk is full are never chained; the next line written
says how many went before it (`dropped_before`). Once space returns the log verifies whole,
and the gaps it declares add up to the records the sidecar counted as dropped.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp
import orjson
import pytest

from proxy.cli import main
from proxy.sim import running_sim
from tests.support.metrics import Scrape
from tests.support.process import start_sidecar
from tests.support.sim import chat, fast
from tests.support.tmpfs import resize, tmpfs

WAIT_S = 60.0
REQUESTS = 400  # ~300 KB of observations: the 64 KiB disk and the 16 KiB queue fill many times


async def scrape(proxy: str) -> Scrape:
    async with aiohttp.ClientSession() as client, client.get(proxy + "/metrics") as response:
        return Scrape(await response.text())


async def drained(proxy: str) -> None:
    """Wait (bounded) until no evidence waits for the disk."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while (await scrape(proxy)).value("cachewitness_evidence_pending_bytes") > 0:
        assert loop.time() < deadline, "the evidence still waits for the disk"
        await asyncio.sleep(0.05)


async def test_records_dropped_on_a_full_disk_are_declared_by_the_next_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with tmpfs(tmp_path / "disk", "64k") as disk:
        evidence = disk / "cachewitness.jsonl"
        async with running_sim(fast("vllm")) as engine:
            process, proxy = await start_sidecar(
                engine, tmp_path, "--evidence", str(evidence), "--evidence-queue-max-bytes", "16384"
            )
            try:
                async with aiohttp.ClientSession() as client:
                    for n in range(REQUESTS):
                        async with client.post(proxy + "/v1/chat/completions", json=chat(f"full {n}")) as r:
                            assert r.status == 200
                            await r.read()
                    full = await scrape(proxy)
                    assert full.value("cachewitness_evidence_dropped_total", reason="queue_full") > 0
                    resize(disk, "64m")  # space returns: what waits is written, then a line after the gap
                    await drained(proxy)
                    async with client.post(proxy + "/v1/chat/completions", json=chat("after")) as r:
                        assert r.status == 200
                        await r.read()
                    dropped = int(full.value("cachewitness_evidence_dropped_total", reason="queue_full"))
                    after = await scrape(proxy)
                    assert after.value("cachewitness_evidence_dropped_total", reason="queue_full") == dropped
            finally:
                process.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(process.wait(), timeout=WAIT_S) == 0
        lines = evidence.read_bytes().splitlines()
        declared = [orjson.loads(line).get("dropped_before", 0) for line in lines]
        assert sum(declared) == dropped > 0, (sum(declared), dropped)
        code = main(["evidence", "verify", str(evidence)])
        out = capsys.readouterr().out
    assert code == 0, out
    assert f"gaps: {dropped} records dropped, declared" in out
