"""The engines as they ship now, on the simulator over real sockets (docs/engines.md, "Engines now").

vLLM's Rust front end (a bare 200 the canary must judge, 409 refusals, a 400 to reset_external
without a connector) and hybrid models whose cache hits land only on large blocks (the canary
sized from the block the engine reports).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from proxy.engine_state import ENGINE
from tests.support.sidecar import running_request, stack
from tests.support.sim import fast, slow


def _reset_urls(body: dict[str, Any]) -> list[str]:
    """The reset calls of an answer, path and query."""
    return [call["url"].split("/", 3)[3] for call in body["calls"] if "/reset_prefix_cache" in call["url"]]


async def test_the_rust_front_end_is_detected_from_its_version(tmp_path: Path) -> None:
    async with stack(fast("vllm", rust_frontend="bare"), tmp_path) as s:
        info = s.app[ENGINE].info
        assert (info.kind, info.mode) == ("vllm", "rust-frontend")


async def test_a_bare_200_the_canary_found_warm_is_retried_with_a_fresh_canary(tmp_path: Path) -> None:
    # The running request holds its blocks past the drain: the engine refuses the reset, and
    # the Rust front end answers a bare 200. Once the request ends, a retried round clears.
    async with stack(slow("vllm", rust_frontend="bare"), tmp_path, drain_timeout=0.1) as s:
        async with running_request(s, max_tokens=120):
            status, body = await s.reset({"retry_seconds": 20})
        assert status == 200, body
        assert body["verified"] == "verified" and body["answer"] == "accepted_unverified", body
        assert "round" in body["verification"]["reason"]
        canaries = [call for call in body["calls"] if '"canary":"C1"' in (call["body_excerpt"] or "")]
        assert len(canaries) >= 2  # a fresh canary each round
        assert body["attempts"] >= 2


async def test_a_canary_warm_through_the_whole_window_is_a_refusal(tmp_path: Path) -> None:
    async with stack(slow("vllm", rust_frontend="bare"), tmp_path, drain_timeout=0.1) as s:
        async with running_request(s, max_tokens=5000):
            status, body = await s.reset({"retry_seconds": 1.5})
        assert status == 409, body
        assert body["answer"] == "refused" and body["success"] is False
        assert "a fresh canary was still cached" in body["detail"]


async def test_the_rust_front_ends_409_is_a_refusal_retried(tmp_path: Path) -> None:
    async with stack(slow("vllm", rust_frontend="strict"), tmp_path, drain_timeout=0.1) as s:
        async with running_request(s, max_tokens=5000):
            status, body = await s.reset({"retry_seconds": 1.2})
        assert status == 409, body
        assert body["answer"] == "refused" and body["attempts"] >= 2
        assert "blocks are still held" in body["detail"]


async def test_a_400_to_reset_external_resets_the_device_and_names_the_external_tier(tmp_path: Path) -> None:
    async with stack(fast("vllm", rust_frontend="strict"), tmp_path) as s:
        status, body = await s.reset()
        assert status == 200 and body["verified"] == "verified", body
        assert "reset_external requires a KV connector" in body["warning"]
        assert body["verification"]["tiers"]["external"] == "not_requested"
        assert body["verification"]["tiers"]["device"] == "cleared"
        assert _reset_urls(body)[:2] == ["reset_prefix_cache?reset_external=true", "reset_prefix_cache"]


async def test_a_vllm_hybrid_canary_outgrows_the_alignment_block(tmp_path: Path) -> None:
    async with stack(fast("vllm", hybrid_block_size=600), tmp_path) as s:
        status, body = await s.reset()
        assert status == 200 and body["verified"] == "verified", body
        assert body["verification"]["canary_tokens"] >= 1200


async def test_an_sglang_canary_is_sized_from_its_page_size(tmp_path: Path) -> None:
    async with stack(fast("sglang", hybrid_block_size=700), tmp_path) as s:
        status, body = await s.reset()
        assert status == 200 and body["verified"] == "verified", body
        assert body["verification"]["canary_tokens"] >= 1400
