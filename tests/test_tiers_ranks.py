"""Every tier and every rank of a reset, on the simulator over real sockets (docs/reset.md).

The canary's probes say which cache tier still served them (`verification.tiers`); SGLang's
HiCache storage tier is cleared with each reset (`clear_storage_tier`); a data-parallel engine
is proven rank by rank (`verification.ranks`), one rank the reset left warm contradicting it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from tests.support.sidecar import Stack, stack
from tests.support.sim import fast

ALL_CLEARED = {"device": "cleared", "host": "cleared", "disk": "cleared", "external": "cleared"}


def _urls(body: dict[str, Any]) -> list[str]:
    """The paths of the answer's engine calls, in order."""
    return [call["url"].split("//", 1)[1].split("/", 1)[1].split("?")[0] for call in body["calls"]]


def _canary_ranks(body: dict[str, Any]) -> list[str]:
    """Which canary request each call was (C1, C1 again, ...), in order."""
    names = []
    for call in body["calls"]:
        try:
            excerpt = orjson.loads(call["body_excerpt"] or "null")
        except orjson.JSONDecodeError:
            continue
        if isinstance(excerpt, dict) and "canary" in excerpt:
            names.append(excerpt["canary"])
    return names


async def _records(s: Stack, event_type: str) -> list[dict[str, Any]]:
    """The sidecar's records of one type."""
    async with s.http.get(f"{s.url}/cache/evidence", params={"event_type": event_type}) as resp:
        assert resp.status == 200, await resp.text()
        return [orjson.loads(line) for line in (await resp.read()).splitlines() if line]


async def test_a_warm_host_tier_is_named_and_contradicts_the_reset(tmp_path: Path) -> None:
    async with stack(fast("vllm", host_tier=True), tmp_path) as s:
        status, body = await s.reset({"case_id": "c"})
        assert status == 502, body
        assert body["answer"] == "contradicted" and body["success"] is False
        verification = body["verification"]
        assert verification["tiers"] == {**ALL_CLEARED, "host": "warm"}
        hits = verification["probe_cached_by_tier"]
        assert hits["host"] > 0 and hits["device"] == 0
        # The record says the same as the answer.
        [state] = await _records(s, "infer.cache_state")
        assert state["verification"]["tiers"]["host"] == "warm"


async def test_a_cleared_vllm_reset_clears_every_tier_by_its_counters(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        status, body = await s.reset()
        assert status == 200 and body["verified"] == "verified", body
        assert body["verification"]["tiers"] == ALL_CLEARED
        assert body["verification"]["probe_cached_by_tier"] == {
            "device": 0,
            "host": 0,
            "disk": 0,
            "external": 0,
        }
        assert "ranks" not in body["verification"]  # one rank: no list


async def test_vllm_before_reset_external_did_not_ask_its_lower_tiers(tmp_path: Path) -> None:
    async with stack(fast("vllm", version="0.12.0"), tmp_path) as s:
        _status, body = await s.reset()
        assert body["verified"] == "verified", body
        assert body["verification"]["tiers"] == {
            "device": "cleared",
            "host": "not_requested",
            "disk": "not_requested",
            "external": "not_requested",
        }


async def test_the_first_vllm_with_reset_external_asks_every_tier(tmp_path: Path) -> None:
    async with stack(fast("vllm", version="0.13.0"), tmp_path) as s:
        _status, body = await s.reset()
        assert body["verified"] == "verified", body
        assert body["verification"]["tiers"] == ALL_CLEARED


async def test_no_canary_knows_no_tier(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        _status, body = await s.reset({"verify": "none"})
        assert body["verification"]["tiers"] == dict.fromkeys(ALL_CLEARED, "unknown")


async def test_llamacpp_ram_cache_is_the_warm_host_tier(tmp_path: Path) -> None:
    async with stack(fast("llamacpp", slot_save_path=str(tmp_path / "slots"), ram_cache=True), tmp_path) as s:
        status, body = await s.reset()
        assert status == 502 and body["answer"] == "contradicted", body
        assert body["verification"]["tiers"] == {**ALL_CLEARED, "host": "warm"}
        assert body["verification"]["probe_cached_by_tier"] is None  # llama.cpp has no per-tier counter


async def test_sglang_storage_tier_is_cleared_with_the_reset(tmp_path: Path) -> None:
    async with stack(fast("sglang", hicache_storage_backend="file"), tmp_path) as s:
        status, body = await s.reset()
        assert status == 200 and body["verified"] == "verified", body
        urls = _urls(body)
        # Each of the canary's three resets: the flush, then the storage tier's clear.
        assert urls.count("hicache/storage-backend/clear") == 3
        flush = urls.index("flush_cache")
        assert urls[flush + 1] == "hicache/storage-backend/clear"
        assert body["verification"]["tiers"] == ALL_CLEARED
        assert "warning" not in body


async def test_sglang_storage_tier_left_alone_keeps_the_canary(tmp_path: Path) -> None:
    async with stack(fast("sglang", hicache_storage_backend="file"), tmp_path, clear_storage_tier=False) as s:
        status, body = await s.reset()
        assert status == 502 and body["answer"] == "contradicted", body
        assert "hicache/storage-backend/clear" not in _urls(body)
        # No per-tier counter: the storage tier was not asked, the others cannot be told apart.
        assert body["verification"]["tiers"] == {
            "device": "unknown",
            "host": "unknown",
            "disk": "not_requested",
            "external": "unknown",
        }


async def test_sglang_remote_storage_is_the_external_tier(tmp_path: Path) -> None:
    async with stack(
        fast("sglang", hicache_storage_backend="mooncake"), tmp_path, clear_storage_tier=False
    ) as s:
        _status, body = await s.reset()
        assert body["verification"]["tiers"]["external"] == "not_requested"
        assert body["verification"]["tiers"]["disk"] == "unknown"


async def test_every_vllm_rank_is_proven(tmp_path: Path) -> None:
    async with stack(fast("vllm", dp_size=2), tmp_path) as s:
        status, body = await s.reset()
        assert status == 200, body
        assert body["answer"] == "acknowledged" and body["verified"] == "verified"
        ranks = body["verification"]["ranks"]
        assert [(r["rank"], r["verified"]) for r in ranks] == [(0, "verified"), (1, "verified")]
        # A canary's whole run per rank: five canary requests each.
        assert len(_canary_ranks(body)) == 10
        stats = await s.engine.stats()
        assert stats["rank_cache_blocks"] == [0, 0]


async def test_every_ranks_canary_is_taken_out_of_the_counters(tmp_path: Path) -> None:
    # The case after a reset holds both ranks' canaries in the engine's counters; only the
    # sidecar's own traffic is left once they are taken out, so nothing is a bypass.
    async with stack(fast("vllm", dp_size=2), tmp_path) as s:
        status, body = await s.reset({"case_id": "c1"})
        assert status == 200 and len(_canary_ranks(body)) == 10, body
        assert await s.chat(2) == 200
        status, _ = await s.reset()  # ends the case: its counters are reconciled
        assert status == 200
        (case,) = [r for r in await _records(s, "infer.cache_reconciliation") if r["case_id"] == "c1"]
    assert case["bypass"] == {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}, case
    assert case["canary"]["requests"] == 10 and case["verdict"] == "consistent", case


async def test_one_refusing_vllm_rank_contradicts_the_reset(tmp_path: Path) -> None:
    async with stack(fast("vllm", dp_size=2, refusing_rank=1), tmp_path) as s:
        status, body = await s.reset()
        assert status == 502 and body["answer"] == "contradicted", body
        ranks = {r["rank"]: r["verified"] for r in body["verification"]["ranks"]}
        assert ranks == {0: "verified", 1: "contradicted"}
        assert body["verification"]["reason"].startswith("rank 1:")
        assert body["verification"]["tiers"]["device"] == "warm"


async def test_one_refusing_sglang_rank_contradicts_the_reset(tmp_path: Path) -> None:
    async with stack(fast("sglang", dp_size=3, refusing_rank=2), tmp_path) as s:
        status, body = await s.reset()
        assert status == 502, body
        ranks = {r["rank"]: r["verified"] for r in body["verification"]["ranks"]}
        assert ranks == {0: "verified", 1: "verified", 2: "contradicted"}


async def test_an_unproven_multi_rank_reset_is_accepted_unverified(tmp_path: Path) -> None:
    async with stack(fast("sglang", dp_size=2), tmp_path) as s:
        status, body = await s.reset({"verify": "none"})
        assert status == 200, body
        assert body["answer"] == "accepted_unverified"
        assert "success" not in body
        assert [(r["rank"], r["verified"]) for r in body["verification"]["ranks"]] == [
            (0, "unverified"),
            (1, "unverified"),
        ]
