"""What a publisher can make the KV events subscriber keep (issue 45, M3): bounded, whoever sends it.

The sans-IO part on bytes; the rest through `serve`'s app with a rogue publisher on its socket.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgpack
import pytest

from proxy.witnesses.kv_events.state import RankState
from proxy.witnesses.kv_events.wire import (
    MAX_EVENTS_PER_BATCH,
    MAX_HASHES_PER_EVENT,
    OTHER,
    DecodeError,
    Event,
    decode_batch,
)
from tests.support.kv_events import rogue_stack, sidecar_events, until
from tests.support.metrics import scrape


def _batch(events: Sequence[object]) -> bytes:
    payload: bytes = msgpack.packb([1.0, events, 0])
    return payload


def test_invented_types_and_media_are_other() -> None:
    batch = decode_batch(
        _batch([["Invented"], {"type": "Mine"}, ["BlockStored", [1], None, [], 16, None, "X-1"]])
    )
    assert batch.events == (Event(OTHER), Event(OTHER), Event("BlockStored", (1,), OTHER, 0))


@pytest.mark.parametrize(
    "events",
    [
        [["AllBlocksCleared"]] * (MAX_EVENTS_PER_BATCH + 1),
        [["BlockStored", [1] * (MAX_HASHES_PER_EVENT + 1)]],
        [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": 1 << 40}],
    ],
    ids=["events-per-batch", "hashes-per-event", "group"],
)
def test_a_batch_past_a_bound_is_refused(events: list[object]) -> None:
    with pytest.raises(DecodeError):
        decode_batch(_batch(events))


def test_empty_stores_and_emptied_sets_keep_nothing() -> None:
    state = RankState(0, 1000)
    stores: list[list[object]] = [
        ["BlockStored", [], None, [], 16, None, "GPU", None, None, g] for g in range(1000)
    ]
    state.apply(0, decode_batch(_batch(stores)), 1.0, 1.0)
    state.apply(1, decode_batch(_batch([["BlockStored", [5], None, [], 16, None, "CPU"]])), 1.0, 1.0)
    state.apply(2, decode_batch(_batch([["BlockRemoved", [5], "CPU"]])), 1.0, 1.0)
    assert state._sets == {} and state.blocks() == {}


async def test_a_rogues_invented_types_add_no_series(tmp_path: Path) -> None:
    async with rogue_stack(tmp_path) as (s, pub):
        assert await pub.subscribed()
        await pub.send(
            0,
            [[f"Type{i}"] for i in range(500)]
            + [["BlockStored", [i], None, [], 16, None, f"M{i}"] for i in range(500)],
        )
        await until(sidecar_events(s), lambda snaps: snaps[0].batches == 1)
        metrics = await scrape(s.http, s.url)
    assert metrics.label_values("cachewitness_kv_events_total", "type") == {
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
        OTHER,
    }
    assert metrics.value("cachewitness_kv_events_total", type=OTHER) == 500
    assert metrics.label_values("cachewitness_kv_blocks", "medium") == {"GPU", OTHER}
    assert metrics.value("cachewitness_kv_blocks", medium=OTHER) == 500


async def test_a_message_over_the_cap_never_reaches_the_loop(tmp_path: Path) -> None:
    # ZeroMQ drops a message over the cap (4 MiB) before any of it is queued or decoded; the
    # publisher's next batch, once it is connected again, is read as usual.
    async with rogue_stack(tmp_path) as (s, pub):
        assert await pub.subscribed()
        events = sidecar_events(s)
        await pub.send_raw(0, msgpack.packb([1.0, [["BlockStored", [], None, [0] * (5 << 20)]], 0]))
        for seq in range(1, 50):  # a batch sent while it reconnects is dropped: send until one lands
            await pub.send(seq, [["AllBlocksCleared"]])
            if await events.wait_until(lambda snaps: snaps[0].batches > 0, 0.2):
                break
        (snap,) = events.snapshots()
        assert snap.clears >= 1 and "BlockStored" not in snap.events, snap
        async with s.http.get(f"{s.url}/-/healthy") as resp:
            assert resp.status == 200
