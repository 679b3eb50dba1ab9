"""A flood of requests cannot wipe the reset records (issue 27 M7), on serve.py's runner and the simulator.

Three bounds: every id a client sends is stored cut to 128 characters; `infer.cache_state` and
`infer.cache_verification` records live in a file of their own that observations never rotate;
the records of requests the sidecar refused itself are bounded in rate, the rest counted as
dropped with reason `rate`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.config import ConfigError
from proxy.config.load import load_settings
from proxy.forward.ids import ID_CHARS
from tests.support.evidence_files import CHAIN_EVENTS, resets_file, unchained
from tests.support.metrics import scrape
from tests.support.sidecar import stack
from tests.support.sim import chat, fast, words

KIB = 1024
# An 8 KB id, as in the flood (aiohttp takes header lines up to 8,190 bytes).
LONG_ID = "x" * 8000
# Observation records the flood writes: several times what 2 × 32 KiB of evidence holds.
FLOOD = 300
WORKERS = 8
RESET_EVENTS = ("infer.cache_state", "infer.cache_verification")


async def evidence(http: aiohttp.ClientSession, url: str, **filters: str) -> list[dict[str, Any]]:
    """GET /cache/evidence: the records, in the order served."""
    async with http.get(url + "/cache/evidence", params=filters) as response:
        assert response.status == 200, await response.text()
        return [orjson.loads(line) for line in (await response.read()).splitlines() if line]


def on_disk(base: Path, keep: int) -> list[dict[str, Any]]:
    """Every record of one evidence file and its rotations, oldest first, as stored (their chain
    checked link by link: tests/evidence_files.py)."""
    paths = [base.with_name(f"{base.name}.{i}") for i in range(keep, 0, -1)] + [base]
    data = b"".join(path.read_bytes() for path in paths if path.exists())
    unchained(data)
    return [orjson.loads(line) for line in data.splitlines() if line]


async def flood(http: aiohttp.ClientSession, url: str, count: int) -> list[str]:
    """`count` chats, each with its own 8 KB X-Request-Id, from WORKERS clients; the ids sent."""
    ids = [f"{index:06d}-{LONG_ID}" for index in range(count)]
    queue = list(ids)

    async def worker() -> None:
        while queue:
            request_id = queue.pop()
            body = chat(words(4, "flood"))
            async with http.post(
                url + "/v1/chat/completions", json=body, headers={"X-Request-Id": request_id}
            ) as response:
                await response.read()
                assert response.status == 200

    await asyncio.gather(*(worker() for _ in range(WORKERS)))
    return ids


async def test_a_flood_of_long_ids_rotates_the_observations_but_never_the_reset_records(
    tmp_path: Path,
) -> None:
    """The reset's records outlive a flood that rotated every observation of its time away, and
    GET /cache/evidence still serves them, merged with the observations in time order."""
    evidence_file = tmp_path / "evidence" / "cachewitness.jsonl"
    async with stack(fast("vllm"), tmp_path, evidence_max_bytes=32 * KIB, evidence_keep=1) as s:
        status, answer = await s.reset({"session_id": "s-flood", "case_id": "c-flood"})
        assert status == 200, answer
        assert await s.chat(4, "first") == 200  # decides the reset's traffic verdict
        before = await evidence(s.http, s.url)
        (first,) = [r for r in before if r["event_type"] == "infer.cache_observation"]
        sent = await flood(s.http, s.url, FLOOD)
        served = await evidence(s.http, s.url)
        async with s.http.get(s.url + "/cache/state") as response:
            state = await response.json()

    kinds = [r["event_type"] for r in served]
    # The flood rotated the observation history away, but for the request that decided the
    # verdict: the resets file keeps it (issue 45, L2)...
    assert first in served
    assert kinds.count("infer.cache_observation") < FLOOD
    assert evidence_file.with_name("cachewitness.jsonl.1").exists()
    # ...and the reset's own records are still served, as the reset answered them.
    (cache_state,) = [r for r in served if r["event_type"] == "infer.cache_state"]
    # As answered, plus its place in the resets file's chain (the first line after the opening).
    assert cache_state == {**answer["cache_state"], "seq": 2, "prev": cache_state["prev"]}
    (verification,) = [r for r in served if r["event_type"] == "infer.cache_verification"]
    assert (verification["reset_id"], verification["request_id"]) == (answer["reset_id"], first["request_id"])
    assert state["sidecar"]["evidence_resets_path"] == str(resets_file(evidence_file))
    resets = on_disk(resets_file(evidence_file), keep=5)
    kept = [r["event_type"] for r in resets if r["event_type"] not in CHAIN_EVENTS]
    assert kept[:3] == [RESET_EVENTS[0], "infer.cache_observation", RESET_EVENTS[1]]
    # ...and says each observation file the flood's rotations dropped.
    assert kept[3:] and set(kept[3:]) == {"infer.evidence_rotated"}
    # One stream, as before the split: both files' records, each once, in time order.
    stored = on_disk(evidence_file, keep=1) + resets
    # Less the final checkpoint of each file, which shutdown wrote after the read.
    final = [r for r in stored if r["event_type"] == "infer.evidence_checkpoint" and r["final"]]
    assert len(final) == 2
    stored = [r for r in stored if r not in final]
    assert sorted(map(orjson.dumps, served)) == sorted(map(orjson.dumps, stored))
    assert [r["at_ns"] for r in served] == sorted(r["at_ns"] for r in served)
    # Every stored request id is the client's, cut at 128 characters.
    stored_ids = [
        r["request_id"] for r in served if r["event_type"] == "infer.cache_observation" and r != first
    ]
    assert stored_ids and set(stored_ids) <= {request_id[:ID_CHARS] for request_id in sent}


async def test_an_id_that_is_not_the_id_charset_is_cut_at_128_without_splitting_an_escape(
    tmp_path: Path,
) -> None:
    """Escaped bytes count as the three characters they are stored as; a cut never leaves half an escape."""
    async with stack(fast("vllm"), tmp_path) as s:
        request_id = "a" * 126 + " tail"  # the space is stored as %20: 126 + 3 > 128
        async with s.http.post(
            s.url + "/v1/chat/completions", json=chat("hi"), headers={"X-Request-Id": request_id}
        ) as response:
            assert response.status == 200
        (record,) = await evidence(s.http, s.url, event_type="infer.cache_observation")
    assert record["request_id"] == "a" * 126


# Refused records allowed per second in the rate test: one second's worth may come at once.
RATE = 2.0
REFUSED = 60
ACCEPTED = 20


async def test_records_of_refused_requests_past_the_rate_bound_are_dropped_and_counted(
    tmp_path: Path,
) -> None:
    """413s (refused by the sidecar, no engine work) past evidence_rejected_per_s are counted, not
    written; the requests the engine answers are all recorded."""
    async with stack(fast("vllm"), tmp_path, max_body_bytes=512, evidence_rejected_per_s=RATE) as s:
        loop = asyncio.get_running_loop()
        started = loop.time()
        for index in range(REFUSED):
            body = chat(words(200, f"big{index}"))
            async with s.http.post(s.url + "/v1/chat/completions", json=body) as response:
                await response.read()
                assert response.status == 413
        elapsed = loop.time() - started
        for index in range(ACCEPTED):
            assert await s.chat(4, f"ok{index}") == 200
        records = await evidence(s.http, s.url, event_type="infer.cache_observation")
        metrics = await scrape(s.http, s.url)

    rejected = [r for r in records if r["outcome"] == "rejected"]
    dropped = metrics.value("cachewitness_evidence_dropped_total", reason="rate")
    assert len(rejected) + dropped == REFUSED
    # At most one second's worth at once, then RATE a second, over the time the 413s took.
    assert 1 <= len(rejected) <= RATE + RATE * elapsed, (len(rejected), elapsed)
    assert len(records) - len(rejected) == ACCEPTED
    assert metrics.value("cachewitness_evidence_dropped_total", reason="queue_full") == 0


@pytest.mark.parametrize(
    ("resets", "rotation"),
    [("./e/cachewitness.jsonl", "the evidence file"), ("./e/cachewitness.jsonl.2", "one of its rotations")],
)
def test_the_reset_records_file_must_be_a_file_of_its_own(resets: str, rotation: str) -> None:
    """A resets path the observation file would rotate over is refused at start, naming both keys."""
    flags = {"evidence": "./e/cachewitness.jsonl", "evidence_resets_path": resets}
    with pytest.raises(ConfigError, match="evidence_resets_path") as raised:
        load_settings(flags, env={})
    assert "rotations" in str(raised.value), rotation


def test_the_default_reset_records_file_sits_beside_the_evidence_file() -> None:
    """`<stem>.resets.jsonl` in the evidence file's directory (its volume), never one of its rotations."""
    settings = load_settings({"evidence": "/var/lib/cw/ev.jsonl"}, env={})
    assert settings.resets_evidence == "/var/lib/cw/ev.resets.jsonl"
    assert (
        load_settings({"evidence": "/var/lib/cw/ev"}, env={}).resets_evidence == "/var/lib/cw/ev.resets.jsonl"
    )
