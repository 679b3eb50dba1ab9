"""The engines as they ship now, on the simulator over real sockets (docs/engines.md, "Engines now").

vLLM's Rust front end (a bare 200 the canary must judge, 409 refusals, a 400 to reset_external
without a connector); hybrid models whose cache hits land only on large blocks (the canary
sized from the block the engine reports); vLLM's wake and llama.cpp's idle sleep as cold
events; llama.cpp's router mode.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson

from proxy.engine_state import ENGINE
from proxy.metrics.per_model import merge_per_model
from tests.support.kv_events import Ports, sidecar_events, until
from tests.support.sidecar import running_request, stack
from tests.support.sim import WAIT_S, fast, slow


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


async def _records(s: Any, event_type: str) -> list[dict[str, Any]]:
    """The sidecar's records of one type."""
    async with s.http.get(f"{s.url}/cache/evidence", params={"event_type": event_type}) as resp:
        assert resp.status == 200, await resp.text()
        return [orjson.loads(line) for line in (await resp.read()).splitlines() if line]


async def _wait_event(s: Any, kind: str) -> None:
    """Until the sidecar recorded an engine event of `kind` (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while kind not in [record["kind"] for record in await _records(s, "infer.engine_event")]:
        assert loop.time() < deadline, f"no {kind} event"
        await asyncio.sleep(0.05)


async def test_a_case_that_saw_vllm_wake_is_cold_by_the_wake(tmp_path: Path) -> None:
    # The sleep falls in one case, the wake in the next: the wake alone makes that one cold.
    async with stack(fast("vllm"), tmp_path) as s:
        status, _body = await s.reset({"case_id": "c1"})
        assert status == 200
        async with s.http.post(s.engine.url + "/sleep") as resp:
            assert resp.status == 200
        await _wait_event(s, "slept")
        async with s.http.post(f"{s.url}/cache/cases/c1/close") as resp:
            assert resp.status == 200
        async with s.http.post(s.engine.url + "/wake_up") as resp:
            assert resp.status == 200
        await _wait_event(s, "woke")
        assert await s.chat(2) == 200
        status, _body = await s.reset({"case_id": "c2"})
        assert status == 200
        after_close = [r for r in await _records(s, "infer.cache_reconciliation") if r["case_id"] is None]
        assert after_close and after_close[-1]["verdict"] == "cold_by_restart", after_close


async def test_llamacpp_sleep_and_wake_are_engine_events_and_the_watcher_lets_it_sleep(
    tmp_path: Path,
) -> None:
    # llama-server's /metrics is a task that restarts its idle clock: a watcher reading it while
    # idle would keep the server awake. /props says is_sleeping and wakes nothing.
    config = fast("llamacpp", slot_save_path=str(tmp_path), sleep_idle_seconds=0.8)
    async with stack(config, tmp_path) as s:
        status, body = await s.reset()
        assert status == 200, body
        await _wait_event(s, "slept")
        [slept, *_] = [r for r in await _records(s, "infer.engine_event") if r["kind"] == "slept"]
        assert slept["seen_by"] == "llamacpp /props"
        # Many watcher and health intervals (0.2 s) later the server still sleeps: nothing woke it.
        # Counted from the sleep seen, not from the start: on a loaded machine the reset's own last
        # counter read can land after a short idle time and wake it once, before this window.
        asleep = await s.engine.stats()
        await asyncio.sleep(1.0)
        stats = await s.engine.stats()
        assert stats["sleeping"] is True and stats["wakes_total"] == asleep["wakes_total"], (asleep, stats)
        assert await s.chat(2) == 200  # a request wakes it, cold
        await _wait_event(s, "woke")
        kinds = [r["kind"] for r in await _records(s, "infer.engine_event")]
        assert kinds[-2:] == ["slept", "woke"]


async def test_llamacpp_router_mode_is_detected_and_its_resets_are_unsupported(tmp_path: Path) -> None:
    async with stack(fast("llamacpp", router_mode=True, slot_save_path=str(tmp_path)), tmp_path) as s:
        info = s.app[ENGINE].info
        assert (info.kind, info.mode) == ("llamacpp", "router")
        status, body = await s.reset()
        assert status == 501 and body["answer"] == "unsupported", body
        assert "one llama-server per model" in body["hint"]
        assert body["calls"] == []  # no slot erase, no canary: nothing of the router is a cache


async def test_a_llamacpp_routers_metrics_are_read_per_model(tmp_path: Path) -> None:
    async with stack(fast("llamacpp", router_mode=True, slot_save_path=str(tmp_path)), tmp_path) as s:
        assert await s.chat(2) == 200
        async with s.http.get(f"{s.url}/metrics") as resp:
            text = await resp.text()
        assert "cachewitness_upstream_metrics_up 1.0" in text
        assert 'llamacpp:prompt_tokens_total{model="sim-model"}' in text


def test_router_texts_merge_with_a_model_label_and_one_head_per_family() -> None:
    def child(prompt: int) -> bytes:
        return (
            b"# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
            b"# TYPE llamacpp:prompt_tokens_total counter\n"
            b"llamacpp:prompt_tokens_total %d\n"
            b"# TYPE llamacpp:requests_processing gauge\n"
            b'llamacpp:requests_processing{slot="0"} 1\n' % prompt
        )

    merged = merge_per_model([("a", child(5)), ('b"x', child(7))])
    assert merged.splitlines() == [
        b"# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.",
        b"# TYPE llamacpp:prompt_tokens_total counter",
        b'llamacpp:prompt_tokens_total{model="a"} 5',
        b'llamacpp:prompt_tokens_total{model="b\\"x"} 7',
        b"# TYPE llamacpp:requests_processing gauge",
        b'llamacpp:requests_processing{model="a",slot="0"} 1',
        b'llamacpp:requests_processing{model="b\\"x",slot="0"} 1',
    ]


async def test_a_bare_200_without_a_clear_is_sent_again_under_the_events_witness(tmp_path: Path) -> None:
    ports = Ports()
    config = slow(
        "vllm",
        rust_frontend="bare",
        kv_events_endpoint=ports.endpoint,
        kv_events_replay=ports.replay_endpoint,
    )
    overrides = {"kv_events_endpoint": ports.endpoint, "kv_events_replay": ports.replay_endpoint}
    async with stack(config, tmp_path, drain_timeout=0.1, **overrides) as s:
        await until(sidecar_events(s), lambda snaps: snaps[0].connected)
        async with running_request(s, max_tokens=120):
            status, body = await s.reset({"verify": "events", "retry_seconds": 20})
        events = body["verification"]["witnesses"]["events"]
        assert status == 200 and body["verified"] == "verified", events
        assert len(_reset_urls(body)) >= 2  # the first 200 was followed by no clear
