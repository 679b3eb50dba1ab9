"""KV event endpoints the engine names, followed with no kv_events_* setting (docs/engines.md).

The simulator publishes on ports it picks itself (`tcp://*:0`) and names them at vLLM's
`GET /kv_event_sources` (each of its three shapes) or in SGLang's `/server_info`; the sidecar,
given nothing but the upstream, connects to them, proves resets with them, and follows the
engine to new ports after it restarts. A static `kv_events_endpoint` stays an override.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from proxy.engines.kv_sources import KvSource, parse_sglang_server_info, parse_vllm_sources
from proxy.recorder import RECORDER
from proxy.witnesses.kv_events.subscribers import KvEvents
from tests.support.kv_events import sidecar_events
from tests.support.ports import fixed_ports
from tests.support.sidecar import Stack, stack
from tests.support.sim import WAIT_S, chat, fast, words


async def _following(s: Stack, not_at: str | None = None) -> dict[str, Any]:
    """Until every rank's publisher is connected (at an endpoint other than `not_at`): /cache/state's kv_events."""
    events: KvEvents = sidecar_events(s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        async with s.http.get(f"{s.url}/cache/state") as resp:
            described: dict[str, Any] = (await resp.json())["kv_events"]
        connected = events.running and all(snap.connected for snap in events.snapshots())
        moved = not_at is None or described["ranks"][0]["endpoint"] != not_at
        if connected and moved:
            return described
        assert loop.time() < deadline, f"never followed the engine's publishers; last {described}"
        await asyncio.sleep(0.05)


async def _traffic(s: Stack, tag: str) -> None:
    async with s.http.post(f"{s.url}/v1/chat/completions", json=chat(words(40, tag), 2)) as resp:
        assert resp.status == 200
        await resp.read()


async def _proved_by_events(s: Stack, tag: str) -> None:
    """Traffic, then a reset the events witness verified (with the canary: the default, both)."""
    await _traffic(s, tag)
    status, answer = await s.reset()
    witnesses = answer["verification"]["witnesses"]
    assert status == 200 and answer["verified"] == "verified", witnesses
    assert witnesses["events"]["result"] == "verified" and witnesses["events"]["blocks_before"] > 0


@pytest.mark.parametrize("shape", ["dict", "list", "sources"])
async def test_vllm_publishers_on_ports_of_their_own_are_followed_with_no_setting(
    tmp_path: Path, shape: str
) -> None:
    config = fast(
        "vllm", kv_events_endpoint="tcp://*:0", kv_events_replay="tcp://*:0", kv_events_discovery=shape
    )
    async with stack(config, tmp_path) as s:
        described = await _following(s)
        assert described["learnt_from"] == "vllm GET /kv_event_sources"
        [rank] = described["ranks"]
        assert rank["endpoint"].startswith("tcp://127.0.0.1:") and not rank["endpoint"].endswith(":0")
        assert rank["replay"].startswith("tcp://127.0.0.1:")
        await _proved_by_events(s, "a")


async def test_after_a_restart_on_new_ports_the_sidecar_follows(tmp_path: Path) -> None:
    config = fast("vllm", kv_events_endpoint="tcp://*:0", kv_events_discovery="dict")
    async with stack(config, tmp_path, health_interval=0.1) as s:
        before = (await _following(s))["ranks"][0]["endpoint"]
        async with s.http.post(f"{s.engine.url}/sim/kv_events/restart?reconnect=1") as resp:
            assert resp.status == 200
        after = await _following(s, not_at=before)
        assert after["ranks"][0]["endpoint"] != before
        await _proved_by_events(s, "b")


async def test_sglang_publishers_named_in_server_info_are_followed(tmp_path: Path) -> None:
    port = fixed_ports(1)
    config = fast("sglang", kv_events_endpoint=f"tcp://*:{port}", kv_events_discovery="dict")
    async with stack(config, tmp_path) as s:
        described = await _following(s)
        assert described["learnt_from"] == "sglang GET /server_info"
        assert described["ranks"][0]["endpoint"] == f"tcp://127.0.0.1:{port}"  # `*`: the engine's host
        await _proved_by_events(s, "c")


async def test_discovery_off_asks_nothing(tmp_path: Path) -> None:
    config = fast("vllm", kv_events_endpoint="tcp://*:0", kv_events_discovery="dict")
    async with stack(config, tmp_path, kv_events_discovery="off") as s:
        assert s.app[RECORDER].kv_events is None
        status, answer = await s.reset()
        assert status == 200 and "events" not in answer["verification"].get("witnesses", {})


ENGINE = "10.0.0.7"
ITEM = {"endpoint": "tcp://10.0.0.9:41234", "replay_endpoint": "tcp://*:5558", "topic": "kv"}


@pytest.mark.parametrize(
    "payload",
    [
        {"0": ITEM, "1": {**ITEM, "endpoint": "tcp://*:5560"}},
        [ITEM, {**ITEM, "endpoint": "tcp://*:5560"}],
        {"sources": [ITEM, {**ITEM, "endpoint": "tcp://*:5560"}]},
    ],
)
def test_vllms_three_shapes_read_alike(payload: Any) -> None:
    assert parse_vllm_sources(payload, ENGINE) == (
        KvSource(0, "tcp://10.0.0.9:41234", f"tcp://{ENGINE}:5558", "kv"),
        KvSource(1, f"tcp://{ENGINE}:5560", f"tcp://{ENGINE}:5558", "kv"),
    )


@pytest.mark.parametrize(
    "payload",
    [
        {},
        [],
        {"0": {**ITEM, "endpoint": "tcp://*:0"}},  # unbound: nothing to connect to
        {"0": {**ITEM, "endpoint": "udp://x:1"}},
        {"0": {**ITEM, "publisher": "null"}},
        "nonsense",
    ],
)
def test_nothing_usable_is_no_source(payload: Any) -> None:
    assert parse_vllm_sources(payload, ENGINE) == ()


def test_sglangs_kv_events_name_each_rank_by_port() -> None:
    info = {"kv_events": {"endpoint_host": "*", "endpoint_port_base": 5557, "dp_size": 2}}
    assert [s.endpoint for s in parse_sglang_server_info(info, "::1")] == [
        "tcp://[::1]:5557",
        "tcp://[::1]:5558",
    ]
    assert parse_sglang_server_info({"kv_events": {"endpoint_port_base": "x"}}, ENGINE) == ()
