"""The real vLLM's KV event frames (tests/data/vllm-kv-events.json, by tests/real/capture_kv_events.py).

They pin the format twice: the core must read them, and the simulator must send the same shapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from proxy.witnesses.kv_events.state import RankState
from proxy.witnesses.kv_events.wire import CLEARED, STORED, decode_batch, replay_item
from tests.support.kv_events import Ports, engine, request
from tests.support.sim import WAIT_S, sim

FIXTURE = json.loads((Path(__file__).parent / "data" / "vllm-kv-events.json").read_text())


def frames(name: str) -> list[list[bytes]]:
    """One captured phase's messages."""
    return [[bytes.fromhex(part) for part in message] for message in FIXTURE[name]]


def raw(payload: bytes) -> Any:
    """A payload as plain msgpack values."""
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def test_the_real_engine_held_back_the_clear_while_idle() -> None:
    assert frames("idle") == []  # reset accepted, nothing for 3 s
    [message] = frames("cleared")  # the one-token request released it, in a batch of its own
    topic, seq, payload = message
    assert topic == b"kv" and len(seq) == 8
    assert decode_batch(payload).events[0].kind == CLEARED and len(decode_batch(payload).events) == 1


def test_the_real_replay_rebuilds_the_cache_and_its_clear() -> None:
    replies = frames("replay")
    assert [len(reply) for reply in replies] == [4, 4, 4]  # vLLM 0.32 puts the topic in replay replies
    assert replay_item(replies[-1]) is None
    state = RankState(rank=0, max_blocks=100)
    items = [item for item in map(replay_item, replies) if item is not None]
    seq, payload = items[0]
    state.apply(seq, decode_batch(payload), 0.0, 0.0)
    assert state.blocks() == {"GPU": 4} and state.synced  # 559 prompt tokens, 128-token CPU blocks
    seq, payload = items[1]
    state.apply(seq, decode_batch(payload), 0.0, 0.0)
    assert state.blocks() == {} and state.cleared_seq == 1


async def test_the_simulator_sends_what_the_real_vllm_sends() -> None:
    ports = Ports()
    async with sim(engine("vllm", ports)) as s:
        await request(s, 40)
        assert await s.post_json("/reset_prefix_cache", {}) == (200, {"success": True})
        await request(s, 3)
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.connect(ports.replay_endpoint)
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replies: list[list[bytes]] = []
            while not replies or replay_item(replies[-1]) is not None:
                assert await dealer.poll(int(WAIT_S * 1000)), "the simulator did not answer the replay"
                replies.append(await dealer.recv_multipart())
        finally:
            dealer.close(linger=0)
            ctx.term()
    real = frames("replay")
    assert [len(r) for r in replies] == [len(r) for r in real] and replies[-1] == real[-1]
    assert {r[1] for r in replies[:-1]} == {r[1] for r in real[:-1]} == {b"kv"}  # the topic frame
    sim_batches = [raw(r[-1]) for r in replies[:-1]]
    real_batches = [raw(r[-1]) for r in real[:-1]]
    assert [type(b[2]) for b in sim_batches] == [type(b[2]) for b in real_batches]  # [ts, events, rank]
    sim_store, sim_clear = sim_batches[0][1][0], sim_batches[1][1][0]
    real_store, real_clear = real_batches[0][1][0], real_batches[1][1][0]
    assert sim_store["type"] == real_store["type"] == STORED
    assert list(sim_store) == list(real_store)  # the same fields, in the same order
    assert len(sim_store["extra_keys"]) == len(sim_store["block_hashes"])
    assert sim_clear == real_clear == {"type": CLEARED}
