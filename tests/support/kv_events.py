"""Helpers for the KV events tests: free port runs, a simulator that publishes, the subscriber core."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from proxy.recorder import RECORDER
from proxy.witnesses.kv_events.state import RankSnapshot
from proxy.witnesses.kv_events.subscribers import KvEvents, KvEventsConfig
from tests.support.ports import fixed_ports
from tests.support.sidecar import Stack
from tests.support.sidecar import stack as sidecar_stack
from tests.support.sim import WAIT_S, Sim, chat, fast, sim, words


@dataclass
class Ports:
    """The addresses of one engine's events: rank 0's publish and replay ports."""

    ranks: int = 1
    pub: int = field(init=False)
    replay: int = field(init=False)

    def __post_init__(self) -> None:
        # Runs of ports (rank r uses base + r) below the ephemeral range: the simulator binds
        # them only once its app starts (tests/support/ports.py).
        self.pub = fixed_ports(self.ranks)
        self.replay = fixed_ports(self.ranks)

    @property
    def endpoint(self) -> str:
        """Rank 0's publish address."""
        return f"tcp://127.0.0.1:{self.pub}"

    @property
    def replay_endpoint(self) -> str:
        """Rank 0's replay address."""
        return f"tcp://127.0.0.1:{self.replay}"


def engine(dialect: str, ports: Ports, rank: int = 0, **options: Any) -> Any:
    """A fast simulator that publishes its KV events to `ports` as rank `rank`."""
    return fast(
        dialect,
        kv_events_endpoint=ports.endpoint,
        kv_events_replay=ports.replay_endpoint,
        kv_events_rank=rank,
        **options,
    )


def core(ports: Ports, *, replay: bool = True, **options: Any) -> KvEventsConfig:
    """The subscriber core's configuration for `ports`."""
    return KvEventsConfig(
        ports.endpoint, ports.replay_endpoint if replay else None, ranks=ports.ranks, **options
    )


@asynccontextmanager
async def stack(
    dialect: str, *, ports: Ports | None = None, core_options: dict[str, Any] | None = None, **options: Any
) -> AsyncIterator[tuple[Sim, KvEvents]]:
    """A subscriber core, then one simulated engine publishing to it."""
    ports = ports or Ports()
    async with AsyncExitStack() as stack:
        kv = await stack.enter_async_context(KvEvents(core(ports, **(core_options or {}))))
        s = await stack.enter_async_context(sim(engine(dialect, ports, **options)))
        await until(kv, lambda snaps: snaps[0].connected)
        yield s, kv


def sidecar_events(s: Stack) -> KvEvents:
    """A sidecar's KV events subscribers (there with kv_events_endpoint: the recorder holds them)."""
    events = s.app[RECORDER].kv_events
    assert events is not None, "kv_events_endpoint is set: the recorder has the subscribers"
    return events


async def until(
    kv: KvEvents, predicate: Callable[[tuple[RankSnapshot, ...]], bool]
) -> tuple[RankSnapshot, ...]:
    """Wait (bounded) until the core's snapshots satisfy `predicate`; fail with the last ones."""
    if not await kv.wait_until(predicate, WAIT_S):
        raise AssertionError(f"the subscriber never reached the state; last {kv.snapshots()}")
    return kv.snapshots()


async def request(s: Sim, prompt_words: int, tag: str = "w", max_tokens: int = 1) -> None:
    """One chat request whose prompt is `prompt_words` distinct words."""
    status, data = await s.post_json(
        "/v1/chat/completions", chat(words(prompt_words, tag), max_tokens=max_tokens)
    )
    assert status == 200, data


async def caught_up(s: Sim, kv: KvEvents, rank: int = 0) -> tuple[RankSnapshot, dict[str, Any]]:
    """Wait until the core applied every batch the engine published; its snapshot and the engine's stats."""
    stats = await s.stats()
    last = stats["kv_events_seq"] - 1
    snaps = await until(kv, lambda snaps: snaps[rank].last_seq == (None if last < 0 else last))
    return snaps[rank], stats


class Rogue:
    """A publisher that is not the engine: an XPUB (it sees the subscription arrive) on the sidecar's socket."""

    def __init__(self, sock: zmq.asyncio.Socket, topic: bytes) -> None:
        """Wrap a connected XPUB."""
        self.sock = sock
        self.topic = topic

    async def subscribed(self, timeout_s: float = WAIT_S) -> bool:
        """Whether the sidecar's subscription reached it within `timeout_s` (its handshake was admitted)."""
        deadline = time.monotonic() + timeout_s
        while await self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            if (await self.sock.recv()).startswith(b"\x01"):
                return True  # not an unsubscription (the \x00 a dropped connection leaves)
        return False

    async def send(self, seq: int, events: list[Any], ts: float | None = None, rank: int = 0) -> None:
        """Publish one batch of `events` as `[ts, events, rank]` at `seq`."""
        await self.send_raw(seq, msgpack.packb([time.time() if ts is None else ts, events, rank]))

    async def send_raw(self, seq: int, payload: bytes) -> None:
        """Publish one payload at `seq`."""
        await self.sock.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])


@asynccontextmanager
async def rogue(endpoint: str, source: str | None = None, topic: bytes = b"kv") -> AsyncIterator[Rogue]:
    """A rogue publisher connected to `endpoint` (a tcp one from the address `source`, if given)."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint if source is None else f"tcp://{source}:0;{endpoint.removeprefix('tcp://')}")
    try:
        yield Rogue(sock, topic)
    finally:
        sock.close(linger=0)
        ctx.term()


@asynccontextmanager
async def rogue_stack(
    tmp_path: Path, source: str | None = None, **overrides: Any
) -> AsyncIterator[tuple[Stack, Rogue]]:
    """A vLLM simulator that publishes nothing behind a sidecar binding a KV-events socket, and a rogue
    publisher on that socket (from `source`), its subscription not awaited."""
    ports = Ports()
    async with (
        sidecar_stack(fast("vllm"), tmp_path, kv_events_endpoint=ports.endpoint, **overrides) as s,
        rogue(ports.endpoint, source) as pub,
    ):
        yield s, pub


CLEAR = [["AllBlocksCleared"]]


@asynccontextmanager
async def flooding(
    pub: Rogue, first: int = 0, *, repeat: bool = False, events: list[Any] = CLEAR
) -> AsyncIterator[Callable[[], int]]:
    """`pub` sends `events` every 50 ms from seq `first` on (at `first` each time with `repeat`: a
    restart each); yields what the next seq would be."""
    seq = first

    async def loop() -> None:
        nonlocal seq
        while True:
            await pub.send(seq, events)
            seq += 0 if repeat else 1
            await asyncio.sleep(0.05)

    task = asyncio.create_task(loop())
    try:
        yield lambda: seq
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
