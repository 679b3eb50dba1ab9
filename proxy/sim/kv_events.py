"""The simulator's KV cache events: what vLLM and SGLang publish over ZeroMQ, in their formats.

A PUB socket sends `[topic, seq (u64 big-endian), msgpack batch]`, one batch per engine step; a
ROUTER socket answers replay requests `[b"", start_seq]` from a buffer of the last batches, then
an end marker (seq -1). The three dialects (docs/simulator.md, "KV cache events"):

- `vllm` (0.32+): events are maps tagged by "type"; replay replies carry the topic frame
  (tests/data/vllm-kv-events.json holds the real engine's frames).
- `vllm-legacy` (the msgspec `array_like` releases): events are positional arrays; replay
  replies have no topic frame.
- `sglang`: positional arrays, signed int64 hashes, no topic frame in replay replies.

The batch is `[ts, events, dp_rank]` in all three.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

__all__ = ["FORMATS", "KvEventPublisher", "kv_event_sources", "sglang_kv_events"]

FORMATS = ("vllm", "vllm-legacy", "sglang")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
BUFFER_STEPS = 10_000  # vLLM's and SGLang's default replay buffer (`buffer_steps`)
_MASK64 = (1 << 64) - 1
_REBIND_TRIES = 50  # a closed socket's port is freed by ZeroMQ's I/O thread, a moment later


def token_id(token: str) -> int:
    """A stable id for one of the simulator's word tokens."""
    return zlib.crc32(token.encode()) & 0x7FFFFFFF


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Rank r's address: the tcp port + r, as vLLM and SGLang offset theirs."""
    if rank == 0:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def _bind(sock: zmq.Socket[bytes] | zmq.asyncio.Socket, address: str) -> str:
    """Bind; `tcp://*:0` binds a free loopback port (vLLM: the node's IP) and says which."""
    if address != "tcp://*:0":
        sock.bind(address)
        return address
    sock.bind("tcp://127.0.0.1:0")
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


class KvEventPublisher:
    """Publishes one engine rank's cache changes; the prefix cache tells it of each (CacheListener)."""

    def __init__(
        self,
        fmt: str,
        endpoint: str,
        replay: str | None,
        *,
        topic: str = "kv",
        rank: int = 0,
        block_size: int = 16,
        drop_every: int = 0,
    ) -> None:
        """Prepare the sockets (`start` opens them). `drop_every` N: every Nth batch is only replayable."""
        if fmt not in FORMATS:
            raise ValueError(f"kv events format must be one of {', '.join(FORMATS)}")
        self.fmt = fmt
        self.endpoint = rank_endpoint(endpoint, rank)
        self.replay = None if replay is None else rank_endpoint(replay, rank)
        self.topic = topic.encode()
        self.rank = rank
        self.block_size = block_size
        self.drop_every = drop_every
        self.seq = 0
        self.published = 0
        self.dropped = 0
        self._pending: list[Any] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_STEPS)
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        # The addresses bound, as the engine reports them: `tcp://*:0` binds a free port of the
        # node's IP (here 127.0.0.1, as vLLM with VLLM_HOST_IP=127.0.0.1), a fixed `*` port is said as is.
        self.bound_endpoint = self.endpoint
        self.bound_replay = self.replay

    # -- the cache's changes (proxy/sim/cache.py CacheListener) ---------------------------------
    def stored(self, hashes: list[int], parent: int | None, tokens: Sequence[str]) -> None:
        """New blocks: one BlockStored event."""
        ids = [token_id(t) for t in tokens]
        hs, par = [self._hash(h) for h in hashes], None if parent is None else self._hash(parent)
        if self.fmt == "vllm":
            self._pending.append(
                {
                    "type": "BlockStored",
                    "block_hashes": hs,
                    "parent_block_hash": par,
                    "token_ids": ids,
                    "block_size": self.block_size,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None] * len(hs),
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                }
            )
        elif self.fmt == "vllm-legacy":
            self._pending.append(["BlockStored", hs, par, ids, self.block_size, None, "GPU", None])
        else:
            self._pending.append(["BlockStored", hs, par, ids, self.block_size, None, "GPU"])

    def removed(self, hashes: list[int]) -> None:
        """Evicted blocks: one BlockRemoved event."""
        hs = [self._hash(h) for h in hashes]
        if self.fmt == "vllm":
            self._pending.append(
                {"type": "BlockRemoved", "block_hashes": hs, "medium": "GPU", "group_idx": 0}
            )
        else:
            self._pending.append(["BlockRemoved", hs, "GPU"])

    def cleared(self) -> None:
        """The whole cache dropped: AllBlocksCleared, which names nothing else."""
        self._pending.append({"type": "AllBlocksCleared"} if self.fmt == "vllm" else ["AllBlocksCleared"])

    def _hash(self, value: int) -> int:
        """vLLM sends u64 block hashes; SGLang signed int64 ones (`hash_str_to_int64`)."""
        u64 = value & _MASK64
        return u64 - (1 << 64) if self.fmt == "sglang" and u64 >= 1 << 63 else u64

    # -- batches ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Publish what is pending as one batch (an engine step's events); nothing when none."""
        if not self._pending:
            return
        payload = msgpack.packb([time.time(), self._pending, self.rank], use_bin_type=True)
        self._pending = []
        seq, self.seq = self.seq, self.seq + 1
        self._buffer.append((seq, payload))
        if self.drop_every and (seq + 1) % self.drop_every == 0:
            self.dropped += 1  # lost on the way, still in the replay buffer
            return
        if self._pub is not None:
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                self.published += 1

    def forget(self) -> None:
        """A new engine life: seq from 0 again, an empty replay buffer, nothing pending."""
        self.seq = 0
        self._buffer.clear()
        self._pending = []

    def stats(self) -> dict[str, object]:
        """Members of `/sim/stats`."""
        return {
            "kv_events_seq": self.seq,
            "kv_events_published": self.published,
            "kv_events_dropped": self.dropped,
            "kv_events_pending": len(self._pending),
        }

    # -- sockets ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the PUB socket (bound when its address has `*`, else connected, as vLLM does) and the ROUTER."""
        self._ctx = zmq.asyncio.Context()
        try:
            await self._open()
        except BaseException:
            await self.close()  # an address taken: nothing is left open behind the error
            raise

    async def _open(self) -> None:
        assert self._ctx is not None
        if self.replay is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            for attempt in range(_REBIND_TRIES):
                try:
                    self.bound_replay = _bind(router, self.replay)
                    break
                except zmq.ZMQError:
                    if attempt == _REBIND_TRIES - 1:
                        router.close(linger=0)
                        raise
                    await asyncio.sleep(0.02)
            self._router = router
            self._task = asyncio.create_task(self._serve_replays(router), name="sim-kv-replay")
        # The replay socket first: an engine answers replays before it publishes.
        pub: zmq.Socket[bytes] = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        try:
            if "*" in self.endpoint:
                self.bound_endpoint = _bind(pub, self.endpoint)
            else:
                pub.connect(self.endpoint)
        except zmq.ZMQError:
            pub.close(linger=0)  # the context's term() waits for every socket
            raise
        self._pub = pub

    async def _close_sockets(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    async def reconnect(self) -> None:
        """Close and reopen both sockets, as a restarted engine's new process does."""
        await self._close_sockets()
        await self._open()

    async def close(self) -> None:
        """Close the sockets and the context."""
        await self._close_sockets()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _serve_replays(self, router: zmq.asyncio.Socket) -> None:
        """Answer `[identity, b"", start_seq]` with every buffered batch from start_seq, then the end marker."""
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                continue  # what vLLM does with a malformed request: nothing
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            with_topic = self.fmt == "vllm"
            for seq, payload in list(self._buffer):
                if seq >= start:
                    head = [client, b"", self.topic] if with_topic else [client, b""]
                    await router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            end = [client, b"", b"", END_SEQ, b""] if with_topic else [client, b"", END_SEQ, b""]
            await router.send_multipart(end)


def kv_event_sources(publisher: KvEventPublisher | None, shape: str | None) -> Any:
    """vLLM's `GET /kv_event_sources` body: the publisher's config by rank, in `shape`; {} without one."""
    if publisher is None or shape is None:
        return {}
    item = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": publisher.bound_endpoint,
        "replay_endpoint": publisher.bound_replay,
        "buffer_steps": BUFFER_STEPS,
        "hwm": 100_000,
        "max_queue_size": 100_000,
        "topic": publisher.topic.decode(),
    }
    if shape == "list":
        return [item]
    if shape == "sources":
        return {"sources": [{**item, "data_parallel_rank": publisher.rank}]}
    return {str(publisher.rank): item}


def sglang_kv_events(
    publisher: KvEventPublisher | None, shape: str | None, dp_size: int
) -> dict[str, Any] | None:
    """SGLang's `/server_info` `kv_events` (#35714): rank 0's host and port, and the ranks."""
    if publisher is None or shape is None:
        return None
    host, _, port = publisher.bound_endpoint.removeprefix("tcp://").rpartition(":")
    return {"endpoint_host": host, "endpoint_port_base": int(port) - publisher.rank, "dp_size": dp_size}
