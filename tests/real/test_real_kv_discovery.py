"""The real vLLM names its KV event publishers at GET /kv_event_sources; a sidecar with no
kv_events_* setting follows them, proves resets with them, and follows the engine to new ports
after a restart (docs/engines.md).

vLLM binds `tcp://*:0` to this node's IP and an OS-chosen port and reports what it bound; the
sidecar learns it from the engine alone. One module-scoped engine, restarted once: each start
costs a minute or two on 2 cores.
"""

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
from tests.real.sidecar_client import cache_state, complete, eventually, long_prompt, metric_value, reset
from tests.support.client import CLIENT_TIMEOUT

# The sidecar re-asks every health interval while a rank has no publisher; the old engine's
# publisher must first be seen gone (a subscriber's heartbeat), hence more than one interval.
REDISCOVER_WAIT_S = 60.0
EVENTS_CONFIG = json.dumps(
    {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:0",
        "replay_endpoint": "tcp://*:0",
        "topic": "kv",
    }
)


@dataclass
class Discovered:
    """A vLLM publishing on ports it picked, behind a sidecar told nothing about them."""

    engine: engines.ManagedProcess
    sidecar: engines.ManagedProcess
    model: Path
    port: int

    @property
    def url(self) -> str:
        """The sidecar's base URL."""
        return self.sidecar.base_url


def _start_engine(model: Path, port: int) -> engines.ManagedProcess:
    return engines.start_vllm(
        model, dev_mode=True, extra_args=["--kv-events-config", EVENTS_CONFIG], port=port
    )


@pytest.fixture(scope="module")
def discovered(tiny_hf: Path) -> Iterator[Discovered]:
    """The engine on a fixed HTTP port (found again after its restart), its publishers on any."""
    port = engines.free_port()
    engine = _start_engine(tiny_hf, port)
    evidence_dir = Path(tempfile.mkdtemp(prefix="cw-real-kvdisc-", dir=engines.logs_dir()))
    try:
        # No --kv-events-*: discovery is on by default and the engine is all the sidecar knows.
        sidecar = engines.start_sidecar(engine.base_url, evidence_dir / "ev.jsonl")
    except BaseException:
        engines.stop(engine)
        raise
    pair = Discovered(engine, sidecar, tiny_hf, port)
    yield pair
    engines.stop(pair.sidecar)
    engines.stop(pair.engine)


def _sources(engine: engines.ManagedProcess) -> dict[str, Any]:
    """What vLLM itself answers at GET /kv_event_sources."""
    status, body = engines.http_json("GET", f"{engine.base_url}/kv_event_sources")
    assert status == 200 and isinstance(body, dict) and set(body) == {"0"}, (status, body)
    rank: dict[str, Any] = body["0"]
    assert rank["endpoint"].startswith("tcp://") and not rank["endpoint"].endswith(":0"), body
    return rank


async def _following(s: aiohttp.ClientSession, url: str, endpoint: str) -> dict[str, Any]:
    """Until the sidecar's rank 0 subscribes to `endpoint`: its /cache/state kv_events."""

    async def probe() -> dict[str, Any] | None:
        described: dict[str, Any] = (await cache_state(s, url)).get("kv_events", {})  # absent: no witness
        ranks = described.get("ranks") or [{}]
        return described if described.get("running") and ranks[0].get("endpoint") == endpoint else None

    return await eventually(probe, REDISCOVER_WAIT_S, f"the sidecar subscribed to {endpoint}")


async def _proved_by_events(s: aiohttp.ClientSession, url: str) -> None:
    """Traffic, then a reset that the events witness verified, with blocks seen before it."""
    body = {"model": "tiny", "prompt": long_prompt(), "max_tokens": 4, "temperature": 0}
    await complete(s, url, body)

    # Until the index holds the request's blocks: vLLM publishes them on its own thread, and a
    # reset sent at once can be judged before they arrive (0 blocks before, seen once here).
    async def stored() -> float | None:
        held = await metric_value(s, f"{url}/metrics", "cachewitness_kv_blocks")
        return held if held else None

    await eventually(stored, 10.0, "the request's blocks in the index, by events")
    status, answer = await reset(s, url, verify="events")
    events = answer["verification"]["witnesses"]["events"]
    assert status == 200 and answer["verified"] == "verified", answer["verification"]
    assert events["result"] == "verified" and events["ranks"][0]["cleared"] is True, events
    assert events["blocks_before"] > 0, events


async def test_the_engines_own_publishers_prove_a_reset(discovered: Discovered) -> None:
    named = _sources(discovered.engine)
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        described = await _following(s, discovered.url, named["endpoint"])
        assert described["learnt_from"] == "vllm GET /kv_event_sources"
        assert described["ranks"][0]["replay"] == named["replay_endpoint"]
        await _proved_by_events(s, discovered.url)


async def test_after_a_restart_on_new_ports_the_sidecar_follows(discovered: Discovered) -> None:
    before = _sources(discovered.engine)["endpoint"]
    engines.stop(discovered.engine)
    discovered.engine = _start_engine(discovered.model, discovered.port)
    after = _sources(discovered.engine)
    assert after["endpoint"] != before, (before, after)
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        await _following(s, discovered.url, after["endpoint"])
        await _proved_by_events(s, discovered.url)
