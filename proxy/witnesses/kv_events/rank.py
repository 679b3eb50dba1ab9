"""One engine rank's KV events subscriber: its SUB socket, the socket's monitor, its replay DEALER.

It keeps what the rank's cache holds (proxy/witnesses/kv_events/state.py): live batches applied
in seq order, a gap filled from the engine's replay socket (or marked lost), a publisher that
connects again rebuilt from the replay buffer (a restarted engine). proxy/witnesses/kv_events/subscribers.py
holds one per rank and answers the reset path's questions over all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from proxy.logs import LogThrottle, log_event
from proxy.witnesses.kv_events.state import RankState
from proxy.witnesses.kv_events.wire import (
    DecodeError,
    KvEventsConfig,
    decode_batch,
    epoch_of,
    rank_addresses,
    replay_item,
)

__all__ = ["RankSubscriber"]

log = logging.getLogger("cachewitness.events")

_DRAIN_MAX = 256  # live batches read per wake-up before the notification goes out
# Batches above this are decoded in a worker thread, so a large one does not hold the event loop
# (a few ms of msgpack per 100 KiB; a full 4 MiB batch would stall every request for a while).
_DECODE_OFF_LOOP = 256 << 10
_REPLAY_HWM = 10_000  # vLLM's replay buffer holds 10,000 batches by default
# A publisher counts once its ZMTP handshake is done: the SUB sends its subscription right after.
# One the address check refused (proxy/witnesses/kv_events/subscribers.py) never gets that far.
_PEER_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
ZAP_DOMAIN = b"cachewitness-kv-events"


class RankSubscriber:
    """One rank: its SUB socket (and the socket's monitor), its replay DEALER, its state."""

    def __init__(
        self, ctx: zmq.asyncio.Context, config: KvEventsConfig, rank: int, changed: Callable[[], None]
    ) -> None:
        """Prepare rank `rank`'s sockets (opened by `open`)."""
        self.config = config
        self.state = RankState(rank, config.max_blocks)
        self.busy = False  # a replay is under way: the state is not final
        self._ctx = ctx
        self._changed = changed
        self._endpoint, self._replay_endpoint = rank_addresses(config, rank)
        self._topic = config.topic.encode()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one replay at a time, and no live batch applied during it
        self._throttle = LogThrottle()

    def open(self, admit: bool = False) -> None:
        """Bind (or connect) the SUB socket and start reading it; with `admit`, each publisher's
        handshake goes to the context's ZAP handler, which admits only the engine's addresses."""
        sub = self._ctx.socket(zmq.SUB)
        if admit:
            sub.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.config.hwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._monitor = sub.get_monitor_socket(_PEER_EVENTS)
        self._sub = sub
        try:
            if self.config.connect:
                sub.connect(self._endpoint)
            else:
                sub.bind(self._endpoint)
        except zmq.ZMQError as exc:
            raise OSError(
                f"kv events: cannot {'connect' if self.config.connect else 'bind'} {self._endpoint}: {exc}"
            ) from exc
        self.state.up = True
        self._task = asyncio.create_task(self._run(), name=f"kv-events-rank-{self.state.rank}")

    async def close(self) -> None:
        """Stop reading and close every socket."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
        for sock in (self._monitor, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._monitor = self._dealer = None
        self.state.up = False
        self.state.peers = 0

    async def _run(self) -> None:
        assert self._sub is not None and self._monitor is not None
        poller = zmq.asyncio.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                try:
                    if self._monitor in ready:
                        await self._peer_events()
                    if self._sub in ready:
                        await self._drain()
                except (zmq.ZMQError, DecodeError) as exc:
                    self._warn("kv_events_error", "kv events: a batch could not be read", error=str(exc))
                finally:
                    self._changed()
        finally:
            self.state.up = False

    async def _peer_events(self) -> None:
        assert self._monitor is not None
        while True:
            try:
                frames = await self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.state.peers = max(0, self.state.peers - 1)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.state.refused_publishers += 1
                self._warn(
                    "kv_events_refused",
                    "kv events: a publisher from an address not in kv_events_publishers was refused",
                    rank=self.state.rank,
                )
            else:
                # A publisher (re)connected: a restarted engine, or one that was up before the
                # sidecar. Its replay buffer holds its history from seq 0: rebuild from it.
                self.state.peers += 1
                if self.state.peers > 1:
                    self._second_publisher()
                async with self._lock:
                    await self._resync()

    def _second_publisher(self) -> None:
        """Two publishers on one rank's socket: one is not the engine, and either one's batches may
        be forged. The set is unknown from here, and no reset judged across it is vouched for."""
        st = self.state
        st.extra_publishers += 1
        st.foreign = True
        st.lost()
        # An alarm (every one is counted in cachewitness_kv_event_publishers_extra_total), throttled
        # all the same: a publisher that reconnects in a loop must not flood the log.
        self._warn(
            "kv_events_second_publisher",
            "kv events: a second publisher connected to one rank's socket; the events witness will not vouch",
            level=logging.ERROR,
            rank=st.rank,
            publishers=st.peers,
        )

    async def _drain(self) -> None:
        assert self._sub is not None
        for _ in range(_DRAIN_MAX):
            try:
                frames = await self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            async with self._lock:
                await self._on_live(frames)

    async def _on_live(self, frames: list[bytes]) -> None:
        st = self.state
        if len(frames) != 3 or len(frames[1]) != 8:
            st.decode_errors += 1
            self._warn("kv_events_frames", "kv events: a message that is not [topic, seq, payload]")
            return
        topic, seq_bytes, payload = frames
        if topic != self._topic and not topic.startswith(self._topic + b"\x00"):
            return  # another topic that shares our prefix
        seq = int.from_bytes(seq_bytes, "big")
        epoch = epoch_of(topic)
        if epoch is not None and st.epoch is not None and epoch != st.epoch:
            st.restarted()
        st.epoch = epoch if epoch is not None else st.epoch
        verdict = st.classify(seq)
        if verdict == "restart":
            st.restarted()
            log_event(log, logging.WARNING, "kv events: the engine restarted", rank=st.rank, seq=seq)
            verdict = st.classify(seq)
        if verdict == "gap":
            await self._fill(0 if st.applied is None else st.applied + 1, seq)
            verdict = st.classify(seq)
        st.live = seq
        if verdict != "duplicate":
            await self._apply(seq, payload)

    async def _fill(self, start: int, stop: int | None) -> None:
        """A gap from `start` (to `stop`, or to whatever the engine has): replay it, or say it is lost."""
        st = self.state
        before = st.applied
        complete = await self._replay(start, stop)
        if stop is None and st.applied == before:
            return  # a catch-up that found nothing missing
        st.gaps += 1
        if complete:
            st.replayed_gaps += 1
            return
        st.unreplayed_gaps += 1
        st.lost()
        self._warn("kv_events_gap", "kv events: a gap could not be replayed", rank=st.rank, start=start)

    async def catch_up(self) -> None:
        """Ask the replay socket for anything after the last batch: a lost last batch shows no gap."""
        if self._replay_endpoint is not None:
            async with self._lock:
                await self._fill(0 if self.state.applied is None else self.state.applied + 1, None)

    async def _apply(self, seq: int, payload: bytes) -> None:
        try:
            if len(payload) > _DECODE_OFF_LOOP:
                batch = await asyncio.to_thread(decode_batch, payload)
            else:
                batch = decode_batch(payload)
        except DecodeError as exc:
            self.state.skip(seq)
            self._warn(
                "kv_events_decode",
                "kv events: a batch could not be decoded",
                rank=self.state.rank,
                error=str(exc),
            )
            return
        self.state.apply(seq, batch, time.time(), time.monotonic())

    async def _replay(self, start: int, stop: int | None) -> bool:
        """Ask the engine for its batches from `start` and apply those in order.

        True when the replay ended within the time bound and left no hole before `stop` (None:
        up to whatever the engine has). Replies arrive in order and are applied as they come,
        so memory stays bounded by the block set's cap.
        """
        if self._replay_endpoint is None:
            return False
        st = self.state
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.replay_timeout_s
        dealer = self._replay_socket()
        self.busy = True
        complete = True
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await dealer.poll(int(remaining * 1000) + 1):
                    self._drop_replay_socket()  # late replies must not meet the next request
                    return False
                item = replay_item(await dealer.recv_multipart())
                if item is None:
                    break
                seq, payload = item
                expected = 0 if st.applied is None else st.applied + 1
                if seq < expected:
                    continue
                if seq > expected:
                    complete = False  # the engine's buffer no longer holds what is missing
                    st.lost()
                # Batches past `stop` are applied too: the live socket's copies then read as duplicates.
                await self._apply(seq, payload)
        except DecodeError:
            self._drop_replay_socket()
            return False
        except asyncio.CancelledError:
            self._drop_replay_socket()
            raise
        finally:
            self.busy = False
        return complete and (stop is None or (st.applied is not None and st.applied >= stop - 1))

    def _replay_socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            assert self._replay_endpoint is not None
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            # The engine's own replay socket, a whole buffer at once: a ROUTER drops what overflows.
            dealer.setsockopt(zmq.RCVHWM, _REPLAY_HWM)
            dealer.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
            dealer.connect(self._replay_endpoint)
            self._dealer = dealer
        return self._dealer

    def _drop_replay_socket(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    async def _resync(self) -> None:
        """Rebuild the set from the engine's replay buffer, from seq 0."""
        if self._replay_endpoint is None:
            return
        st = self.state
        origin, clears = st.origin_ts, st.clears
        # The last seq of this life seen either way, live or replayed: a history known only
        # through a replay (no batch came live since) still tells a new life from this one.
        last = max((seq for seq in (st.live, st.applied) if seq is not None), default=None)
        st.forget()
        # A new DEALER: the old one may still hold a connection to a replay socket that is gone.
        self._drop_replay_socket()
        complete = await self._replay(0, None)
        if not complete:
            st.unreplayed_gaps += 1
            st.lost()
            st.live = last  # a seq that starts again is still seen as a restart
            self._warn(
                "kv_events_resync", "kv events: the engine's history could not be replayed", rank=st.rank
            )
            return
        if st.applied is None:
            st.synced = True  # an empty buffer: the engine has published nothing yet
        # Another engine life if its first batch is not the one seen before, or it has fewer
        # (none at all: a life that published, then an empty buffer). A replay of the same life
        # reaches at least `last`; one that cannot start at 0 is incomplete, above.
        if (origin is not None and st.origin_ts is not None and origin != st.origin_ts) or (
            last is not None and (st.applied is None or st.applied < last)
        ):
            st.restarts += 1
            st.incarnation += 1
            if st.clears > clears:
                st.cleared_incarnation = st.incarnation
            log_event(log, logging.WARNING, "kv events: the engine restarted", rank=st.rank)

    def _warn(self, key: str, msg: str, level: int = logging.WARNING, **fields: Any) -> None:
        count = self._throttle.due(key)
        if count:
            log_event(log, level, msg, count=count, **fields)
