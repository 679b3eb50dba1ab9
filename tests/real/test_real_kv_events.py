"""The real vLLM's KV cache events as a witness: resets verified by events and the canary, cases flagged, restarts."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.real import engines
from tests.real.sidecar_client import (
    complete,
    eventually,
    evidence,
    long_prompt,
    metric_value,
    new_case,
    reset,
    tags,
)
from tests.support.client import CLIENT_TIMEOUT

MODEL = "tiny"
RESTART_WAIT_S = 120.0


@dataclass
class EventsPair:
    """A vLLM publishing its KV events to the sidecar in front of it; the engine may be restarted."""

    engine: engines.ManagedProcess
    sidecar: engines.ManagedProcess
    engine_args: list[str]
    model: Path
    port: int

    @property
    def url(self) -> str:
        """The sidecar's base URL."""
        return self.sidecar.base_url


def _kv_config(pub: int, replay: int) -> dict[str, Any]:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "topic": "kv",
    }


@pytest.fixture(scope="module")
def vllm_events(tiny_hf: Path) -> Iterator[EventsPair]:
    """vLLM with --kv-events-config, behind a sidecar that binds its publish port (the upstream moves on restart: fixed port)."""
    pub, replay, port = engines.free_port(), engines.free_port(), engines.free_port()
    config = _kv_config(pub, replay)
    args = ["--kv-events-config", json.dumps(config)]
    engine = engines.start_vllm(tiny_hf, dev_mode=True, extra_args=args, port=port)
    evidence_dir = Path(tempfile.mkdtemp(prefix="cw-real-kv-", dir=engines.logs_dir()))
    try:
        sidecar = engines.start_sidecar(
            engine.base_url,
            evidence_dir / "ev.jsonl",
            ["--kv-events-endpoint", config["endpoint"], "--kv-events-replay", config["replay_endpoint"]],
        )
    except BaseException:
        engines.stop(engine)
        raise
    pair = EventsPair(engine, sidecar, args, tiny_hf, port)
    yield pair
    engines.stop(pair.sidecar)
    engines.stop(pair.engine)


async def _traffic(s: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> None:
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 4, "temperature": 0}
    await complete(s, url, body, headers=headers)


async def _case_start(s: aiohttp.ClientSession, url: str, case_id: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        found = await evidence(s, url, case_id=case_id, event_type="infer.cache_blocks")
        return next((r for r in found if r["trigger"] == "case_start"), None)

    return await eventually(probe, 10.0, f"the case start of {case_id}")


async def test_a_reset_is_verified_by_events_and_by_the_canary(vllm_events: EventsPair) -> None:
    session_id, case_id = new_case()
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        await _traffic(s, vllm_events.url)
        status, answer = await reset(
            s, vllm_events.url, session_id=session_id, case_id=case_id, verify="both"
        )
        witnesses = answer["verification"]["witnesses"]
        assert status == 200 and answer["verified"] == "verified", answer["verification"]
        assert witnesses["events"]["result"] == "verified", witnesses["events"]
        assert witnesses["events"]["ranks"][0]["cleared"] is True
        assert witnesses["events"]["blocks_before"] > 0  # the earlier traffic and the canary's blocks
        assert witnesses["canary"]["result"] == "verified", witnesses["canary"]
        assert answer["cache_state"]["verification"]["witnesses"]["events"]["result"] == "verified"
        await _traffic(s, vllm_events.url, tags(session_id, case_id))
        start = await _case_start(s, vllm_events.url, case_id)
    assert start["verification"]["result"] == "clean", start


async def test_traffic_between_the_reset_and_the_case_is_flagged(vllm_events: EventsPair) -> None:
    session_id, case_id = new_case()
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        status, answer = await reset(
            s, vllm_events.url, session_id=session_id, case_id=case_id, verify="events"
        )
        assert status == 200 and answer["verified"] == "verified", answer["verification"]
        await _traffic(s, vllm_events.url)  # someone else's request, untagged

        # Until the index holds that request's blocks: vLLM publishes them on its own thread, and
        # under load they reached the sidecar after the case's first request (a `clean` start).
        # (Waiting for any cache_blocks record waited for nothing: the reset's own was there.)
        async def stored() -> float | None:
            held = await metric_value(s, f"{vllm_events.url}/metrics", "cachewitness_kv_blocks")
            return held if held else None

        await eventually(stored, 10.0, "the other request's blocks in the index")
        await _traffic(s, vllm_events.url, tags(session_id, case_id))
        start = await _case_start(s, vllm_events.url, case_id)
    check = start["verification"]
    assert check["result"] == "flagged" and check["blocks"] > 0, start
    assert f"{check['blocks']} cached blocks" in check["reason"]


async def test_a_killed_and_restarted_engine_is_seen_as_a_restart(vllm_events: EventsPair) -> None:
    engines.stop(vllm_events.engine)
    vllm_events.engine = engines.start_vllm(
        vllm_events.model, dev_mode=True, extra_args=vllm_events.engine_args, port=vllm_events.port
    )
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        await _traffic(s, vllm_events.url)  # the new engine's first batch: its seq starts at 0 again

        async def restarted() -> str | None:
            async with s.get(f"{vllm_events.url}/metrics") as resp:
                text = await resp.text()
            return "up" if "cachewitness_kv_events_up 1.0" in text else None

        await eventually(restarted, RESTART_WAIT_S, "the events witness back")
        status, answer = await reset(s, vllm_events.url, verify="events")
        assert status == 200 and answer["verified"] == "verified", answer["verification"]
        found = await evidence(s, vllm_events.url, event_type="infer.cache_blocks")
    (at_reset,) = [r for r in found if r["reset_id"] == answer["reset_id"] and r["trigger"] == "reset"]
    assert at_reset["ranks"][0]["restarts"] >= 1, at_reset
