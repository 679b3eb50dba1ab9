"""Decoding every batch shape the engines have published (the ones the simulator does not send)."""

from __future__ import annotations

import msgpack
import pytest

from proxy.witnesses.kv_events.wire import Batch, DecodeError, Event, decode_batch, replay_item

SHA = bytes(range(32))  # a vLLM block hash under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
SHA_LOW64 = int.from_bytes(SHA[-8:], "big")


def test_a_batch_as_a_map_with_byte_hashes() -> None:
    # msgspec writes EventBatch as a map when the struct is not array_like (seen on vLLM's main).
    payload = msgpack.packb(
        {
            "ts": 5.0,
            "events": [
                {"type": "BlockStored", "block_hashes": [SHA], "parent_block_hash": None, "token_ids": [1]},
                {"type": "BlockRemoved", "block_hashes": [SHA], "medium": "CPU", "group_idx": 2},
            ],
            "data_parallel_rank": 3,
        }
    )
    assert decode_batch(payload) == Batch(
        5.0, (Event("BlockStored", (SHA_LOW64,)), Event("BlockRemoved", (SHA_LOW64,), "CPU", 2)), 3
    )


def test_positional_events_with_their_trailing_fields() -> None:
    # vLLM's last array_like release: ..., medium, lora_name, extra_keys, group_idx; SGLang's
    # BlockStoredWithMetadata: ..., medium, {"cache_salt": ...}.
    vllm = ["BlockStored", [7], None, [1, 2], 2, None, "GPU", None, None, 1]
    sglang = ["BlockStored", [-1], None, [1, 2], 2, None, "CPU_PINNED", {"cache_salt": "s"}]
    oldest = ["BlockRemoved", [7]]  # before `medium` existed
    batch = decode_batch(msgpack.packb([1.5, [vllm, sglang, oldest, ["AllBlocksCleared"]], 0]))
    assert batch.events == (
        Event("BlockStored", (7,), "GPU", 1),
        Event("BlockStored", ((1 << 64) - 1,), "CPU_PINNED", 0),
        Event("BlockRemoved", (7,), "GPU", 0),
        Event("AllBlocksCleared"),
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgpack.packb("text"),
        msgpack.packb([1.0, [{"block_hashes": [1]}], 0]),  # an event without a type
        msgpack.packb([1.0, [["BlockStored", "not a list"]], 0]),
        msgpack.packb([1.0, [["BlockRemoved", [1.5]]], 0]),  # a hash that is not an int or bytes
    ],
)
def test_what_is_not_a_batch_is_a_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_replay_replies_with_and_without_the_topic_frame() -> None:
    seq = (9).to_bytes(8, "big")
    end = (-1).to_bytes(8, "big", signed=True)
    assert replay_item([b"", b"kv", seq, b"p"]) == (9, b"p")  # vLLM 0.32+
    assert replay_item([b"", seq, b"p"]) == (9, b"p")  # older vLLM, SGLang
    assert replay_item([b"", b"", end, b""]) is None
    assert replay_item([b"", end, b""]) is None
    with pytest.raises(DecodeError):
        replay_item([b"x", seq, b"p"])
