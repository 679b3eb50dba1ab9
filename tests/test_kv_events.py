"""The engine's KV cache events over real ZeroMQ sockets: the simulator publishes, the core follows."""

from __future__ import annotations

import argparse
import gc
import socket
import warnings
from contextlib import AsyncExitStack

import pytest
import zmq

from proxy.sim import SimConfig, add_sim_arguments, sim_config_from_args
from proxy.witnesses.kv_events.subscribers import KvEvents
from tests.support.kv_events import Ports, caught_up, core, engine, request, stack, until
from tests.support.sim import fast, sim

# Long enough for a published clear to arrive on a loaded machine; only ever waited out when
# the test expects nothing to come.
QUIET_S = 0.5


async def test_stores_and_evictions_track_the_engines_cache() -> None:
    async with stack("vllm", cache_blocks=6) as (s, kv):
        for i in range(4):
            await request(s, 40, tag=f"p{i}")
        snap, stats = await caught_up(s, kv)
        assert snap.events["BlockRemoved"] > 0  # the 6-block cache evicted
        assert snap.blocks == {"GPU": stats["cache_blocks"]}
        assert snap.vouches and snap.unknown_removals == 0


async def test_vllm_publishes_a_resets_clear_only_with_the_next_request() -> None:
    async with stack("vllm") as (s, kv):
        await request(s, 40)
        await caught_up(s, kv)
        marker = kv.mark()
        assert await s.post_json("/reset_prefix_cache", {}) == (200, {"success": True})
        idle = await kv.cleared_since(marker, QUIET_S)
        assert idle.timed_out and not idle.ranks[0].cleared
        assert (await s.stats())["kv_events_pending"] == 1  # held until the next engine step
        await request(s, 3)  # the flush: shorter than a block, one token
        result = await kv.cleared_since(marker, 10)
        assert not result.timed_out and result.vouches
        assert result.ranks[0].blocks == {} and result.ranks[0].seq == result.ranks[0].seq_to


async def test_sglang_publishes_a_flushs_clear_at_once() -> None:
    async with stack("sglang") as (s, kv):
        await request(s, 40)
        await caught_up(s, kv)
        marker = kv.mark()
        async with s.http.post(s.url + "/flush_cache") as resp:
            assert resp.status == 200
        result = await kv.cleared_since(marker, 10)
        assert not result.timed_out and result.vouches


async def test_sglang_signed_hashes_and_topicless_replays_are_read() -> None:
    # Every 2nd batch dropped: half the state arrives through SGLang's replay replies.
    async with stack("sglang", cache_blocks=6, kv_events_drop_every=2) as (s, kv):
        for i in range(5):
            await request(s, 40, tag=f"q{i}")
        snap, stats = await caught_up(s, kv)
        assert snap.replayed_gaps > 0 and snap.unreplayed_gaps == 0
        assert snap.blocks == {"GPU": stats["cache_blocks"]} and snap.unknown_removals == 0
        assert snap.vouches


async def test_vllm_legacy_positional_events_are_read() -> None:
    async with stack("vllm", cache_blocks=6, kv_events_legacy=True, kv_events_drop_every=3) as (s, kv):
        for i in range(4):
            await request(s, 40, tag=f"l{i}")
        snap, stats = await caught_up(s, kv)
        assert snap.events["BlockStored"] > 0 and snap.events["BlockRemoved"] > 0
        assert snap.blocks == {"GPU": stats["cache_blocks"]} and snap.replayed_gaps > 0
        marker = kv.mark()
        assert await s.post_json("/reset_prefix_cache", {}) == (200, {"success": True})
        await request(s, 3)
        assert (await kv.cleared_since(marker, 10)).vouches


async def test_a_dropped_batch_is_replayed() -> None:
    # Batches 2 and 4 of 5 are not sent; each shows as a gap when the next one arrives.
    async with stack("vllm", kv_events_drop_every=2) as (s, kv):
        for i in range(5):
            await request(s, 40, tag=f"d{i}")
        snap, stats = await caught_up(s, kv)
        assert stats["kv_events_dropped"] >= 2
        assert snap.gaps == snap.replayed_gaps > 0 and snap.unreplayed_gaps == 0
        assert snap.blocks == {"GPU": stats["cache_blocks"]} and snap.vouches


async def test_a_gap_without_a_replay_socket_cannot_vouch() -> None:
    async with stack("vllm", kv_events_drop_every=2, core_options={"replay": False}) as (s, kv):
        # Without a replay there is no catching up on batches sent before the subscription took
        # hold either: request until a gap shows (the dropped 2nd batch, or a first one past seq 0).
        for i in range(20):
            await request(s, 40, tag=f"n{i}")
            if kv.snapshots()[0].unreplayed_gaps:
                break
        snaps = await until(kv, lambda snaps: snaps[0].unreplayed_gaps > 0)
        assert not snaps[0].vouches and not snaps[0].synced


async def test_a_catch_up_that_missed_nothing_counts_no_gap() -> None:
    async with stack("vllm") as (s, kv):
        await request(s, 40)
        await caught_up(s, kv)
        for _ in range(3):
            await kv.catch_up(10)
        (snap,) = kv.snapshots()
        assert (snap.gaps, snap.replayed_gaps, snap.unreplayed_gaps) == (0, 0, 0) and snap.vouches


async def test_a_lost_last_batch_is_fetched_while_waiting_for_the_clear() -> None:
    # Batches 2, 4, ... are not sent: the clear's batch (the 2nd) is the last one, so no gap shows.
    async with stack("vllm", kv_events_drop_every=2) as (s, kv):
        await request(s, 40)
        await caught_up(s, kv)
        marker = kv.mark()
        assert await s.post_json("/reset_prefix_cache", {}) == (200, {"success": True})
        await request(s, 3)
        assert (await s.stats())["kv_events_dropped"] == 1
        result = await kv.cleared_since(marker, 10)
        assert not result.timed_out and result.vouches


async def test_a_clear_before_the_marker_does_not_count() -> None:
    async with stack("vllm") as (s, kv):
        before = kv.mark()
        assert await s.post_json("/reset_prefix_cache", {}) == (200, {"success": True})
        await request(s, 3)
        assert (await kv.cleared_since(before, 10)).vouches
        marker = kv.mark()  # after that clear arrived: a reset now has not happened yet
        result = await kv.cleared_since(marker, QUIET_S)
        assert result.timed_out and not result.ranks[0].cleared and not result.vouches


async def test_a_clear_the_clock_cannot_place_is_placed_by_its_seq() -> None:
    # An hour of clock slack (an engine host whose clock may lag) lets the clear's time pass
    # for "after the marker": only its seq, at or below the marker's, says it came before.
    async with stack("vllm", core_options={"clock_slack_s": 3600.0}) as (s, kv):
        assert await s.post_json("/reset_prefix_cache", {}) == (200, {"success": True})
        await request(s, 3)
        snap, _ = await caught_up(s, kv)
        assert snap.clears == 1
        result = await kv.cleared_since(kv.mark(), QUIET_S)
        assert result.timed_out and not result.ranks[0].cleared and not result.vouches


async def test_a_seq_that_starts_again_is_a_restart() -> None:
    async with stack("vllm") as (s, kv):
        for i in range(3):
            await request(s, 40, tag=f"r{i}")
        await caught_up(s, kv)
        marker = kv.mark()
        # The engine's cache empties and its seq goes back to 0, on the same connection.
        assert (await s.post_json("/sim/kv_events/restart", {}))[0] == 200
        await request(s, 40, tag="after")
        snap, stats = await caught_up(s, kv)
        assert snap.restarts == 1
        assert snap.blocks == {"GPU": stats["cache_blocks"]} and snap.vouches
        result = await kv.cleared_since(marker, 10)
        assert result.ranks[0].restarted and not result.ranks[0].cleared


async def test_a_restarted_engines_new_connection_is_a_restart() -> None:
    async with stack("vllm") as (s, kv):
        for i in range(3):
            await request(s, 40, tag=f"c{i}")
        await caught_up(s, kv)
        async with s.http.post(s.url + "/sim/kv_events/restart?reconnect=1") as resp:
            assert resp.status == 200
        snaps = await until(kv, lambda snaps: snaps[0].restarts == 1)
        assert snaps[0].blocks == {} and snaps[0].vouches
        await request(s, 40, tag="after")
        snap, stats = await caught_up(s, kv)
        assert snap.blocks == {"GPU": stats["cache_blocks"]} and snap.restarts == 1


async def test_a_restart_after_a_history_only_replayed_is_a_restart() -> None:
    """The core knew the engine only through its replay buffer (no batch came live), and the new
    engine has published nothing when the core connects again: its empty buffer, where the last
    life had batches, is a new life. (A real vLLM restarted under load showed 0 restarts.)"""
    ports = Ports()
    async with sim(engine("vllm", ports, cache_blocks=6)) as s:
        for i in range(4):
            await request(s, 40, tag=f"h{i}")  # published to nobody: the core replays them
        async with KvEvents(core(ports)) as kv:
            await caught_up(s, kv)
            async with s.http.post(s.url + "/sim/kv_events/restart?reconnect=1") as resp:
                assert resp.status == 200
            snaps = await until(kv, lambda snaps: snaps[0].restarts == 1)
            assert snaps[0].blocks == {}
            await request(s, 40, tag="after")
            snap, stats = await caught_up(s, kv)
            assert snap.restarts == 1 and snap.blocks == {"GPU": stats["cache_blocks"]}


async def test_a_core_started_after_the_engine_rebuilds_from_the_replay_buffer() -> None:
    ports = Ports()
    async with sim(engine("vllm", ports, cache_blocks=6)) as s:
        for i in range(4):
            await request(s, 40, tag=f"e{i}")  # published to nobody
        async with KvEvents(core(ports)) as kv:
            snap, stats = await caught_up(s, kv)
            assert snap.blocks == {"GPU": stats["cache_blocks"]} and snap.vouches


async def test_an_overflowing_set_says_so_and_a_clear_ends_it() -> None:
    async with stack("vllm", core_options={"max_blocks": 4}) as (s, kv):
        for tag in "abc":
            await request(s, 40, tag=tag)
        snap, stats = await caught_up(s, kv)
        assert stats["cache_blocks"] > 4
        assert snap.overflow and not snap.vouches
        marker = kv.mark()
        assert await s.post_json("/reset_prefix_cache", {}) == (200, {"success": True})
        await request(s, 3)
        result = await kv.cleared_since(marker, 10)
        assert result.vouches and not result.ranks[0].overflow


async def test_each_rank_is_followed_on_its_own_ports() -> None:
    ports = Ports(ranks=2)
    async with AsyncExitStack() as stack_:
        kv = await stack_.enter_async_context(KvEvents(core(ports)))
        r0 = await stack_.enter_async_context(sim(engine("vllm", ports, rank=0)))
        r1 = await stack_.enter_async_context(sim(engine("vllm", ports, rank=1)))
        await until(kv, lambda snaps: all(snap.connected for snap in snaps))
        await request(r0, 40)
        await request(r1, 60)
        snap0, stats0 = await caught_up(r0, kv, rank=0)
        snap1, stats1 = await caught_up(r1, kv, rank=1)
        assert snap0.blocks == {"GPU": stats0["cache_blocks"]} and snap1.blocks == {
            "GPU": stats1["cache_blocks"]
        }
        assert stats0["cache_blocks"] != stats1["cache_blocks"]
        marker = kv.mark()
        for s in (r0, r1):
            assert await s.post_json("/reset_prefix_cache", {}) == (200, {"success": True})
        await request(r0, 3)
        half = await kv.cleared_since(marker, QUIET_S)
        assert half.timed_out and [r.cleared for r in half.ranks] == [True, False]
        await request(r1, 3)
        assert (await kv.cleared_since(marker, 10)).vouches


def test_the_simulators_kv_events_flags() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    ns = parser.parse_args(
        [
            "--kv-events-endpoint",
            "tcp://127.0.0.1:5557",
            "--kv-events-replay",
            "tcp://127.0.0.1:5558",
            "--kv-events-legacy",
            "--kv-events-drop-every",
            "3",
            "--kv-events-rank",
            "1",
            "--kv-events-topic",
            "t",
        ]
    )
    config = sim_config_from_args(ns)
    assert config == SimConfig(
        kv_events_endpoint="tcp://127.0.0.1:5557",
        kv_events_replay="tcp://127.0.0.1:5558",
        kv_events_legacy=True,
        kv_events_drop_every=3,
        kv_events_rank=1,
        kv_events_topic="t",
    )
    assert config.kv_events_format == "vllm-legacy"
    with pytest.raises(ValueError, match="vllm and sglang"):
        SimConfig(dialect="llamacpp", kv_events_endpoint="tcp://127.0.0.1:5557")


async def test_an_endpoint_that_cannot_be_bound_fails_the_start() -> None:
    ports = Ports()
    async with KvEvents(core(ports)):
        with pytest.raises(OSError, match="cannot bind"):
            async with KvEvents(core(ports)):
                pass


@pytest.mark.parametrize("taken", ["replay", "pub"])
async def test_a_simulator_whose_events_port_is_taken_fails_to_start_and_leaves_nothing_open(
    taken: str,
) -> None:
    """A port taken (CI: another process had it) fails the start with ZeroMQ's error; its sockets
    and context are closed behind it, not left for the garbage collector to warn about."""
    ports = Ports()
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # The publisher binds only when its address has `*` (else it connects, as vLLM's does).
    endpoint = ports.endpoint.replace("127.0.0.1", "*") if taken == "pub" else ports.endpoint
    try:
        held.bind(("127.0.0.1", ports.replay if taken == "replay" else ports.pub))
        held.listen()
        config = fast("vllm", kv_events_endpoint=endpoint, kv_events_replay=ports.replay_endpoint)
        with pytest.raises(zmq.ZMQError):
            async with sim(config):
                pass
    finally:
        held.close()
    # A context left open warns as it is collected: made an error, pytest's unraisable-exception
    # hook fails this test with it (as it failed the next test on the worker in CI).
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        gc.collect()
