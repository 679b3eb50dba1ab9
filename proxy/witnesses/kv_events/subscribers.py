"""The engine's own cache index as a witness: one ZeroMQ subscriber per engine rank.

vLLM and SGLang publish every block they store and remove, and an AllBlocksCleared when the
cache is reset (docs/simulator.md, "KV cache events", has the formats). Each rank's subscriber
keeps what its cache holds (proxy/witnesses/kv_events/state.py), fills a gap in the seq from the engine's
replay socket, and notices an engine that restarted. The reset path asks it two things:
`mark()` before the reset, then `await cleared_since(marker, timeout)`.

Rank r publishes on the endpoint's port + r and answers replays on the replay port + r (vLLM's
and SGLang's rule). The sidecar binds the endpoint (an engine given a concrete host connects to
it) unless `connect` says the engine binds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable

import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from proxy.witnesses.kv_events.rank import RankSubscriber
from proxy.witnesses.kv_events.state import (
    ClearResult,
    Marker,
    RankClear,
    RankMark,
    RankSnapshot,
    judge_rank,
)
from proxy.witnesses.kv_events.wire import KvEventsConfig, rank_addresses, rank_endpoint

__all__ = [
    "ClearResult",
    "KvEvents",
    "KvEventsConfig",
    "Marker",
    "RankClear",
    "RankMark",
    "RankSnapshot",
    "rank_endpoint",
]


async def resolve(hosts: tuple[str, ...]) -> set[str]:
    """Every address `hosts` name (IP literals as they are); OSError when one cannot be resolved."""
    loop = asyncio.get_running_loop()
    found: set[str] = set()
    for host in hosts:
        try:
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise OSError(f"kv events: cannot resolve the publisher host {host!r}: {exc}") from exc
        found.update(str(info[4][0]) for info in infos)
    return found


class KvEvents:
    """The subscribers of every rank of one engine, and the questions the reset path asks them."""

    def __init__(self, config: KvEventsConfig | None) -> None:
        """Prepare one subscriber per rank (`start` opens them); None: none until `restart_with`."""
        self.config = config
        self._ctx: zmq.asyncio.Context | None = None
        self._ranks: list[RankSubscriber] = []
        self._changed = asyncio.Event()
        self._auth: AsyncioAuthenticator | None = None

    async def start(self) -> None:
        """Open every rank's sockets; raises OSError when an endpoint cannot be bound or a
        publisher's host cannot be resolved."""
        if self.config is None:
            return  # endpoints not known yet (discovery: proxy/witnesses/kv_events/discovery.py)
        self._ctx = zmq.asyncio.Context()
        self._ranks = [
            RankSubscriber(self._ctx, self.config, r, self._notify) for r in range(self.config.ranks)
        ]
        try:
            admit = await self._admission()
            for sub in self._ranks:
                sub.open(admit)
        except OSError:
            await self.close()
            raise

    @property
    def running(self) -> bool:
        """Whether subscribers are open (not before the endpoints are known)."""
        return self._ctx is not None

    async def restart_with(self, config: KvEventsConfig) -> None:
        """Close every socket and open them for `config` (the engine's endpoints changed)."""
        await self.close()
        self.config = config
        await self.start()

    def describe(self) -> dict[str, object]:
        """Each rank's endpoints and where they come from (`/cache/state`)."""
        config = self.config
        if config is None:
            return {"running": False, "ranks": []}
        ranks = [
            {"rank": r, "endpoint": rank_addresses(config, r)[0], "replay": rank_addresses(config, r)[1]}
            for r in range(config.ranks)
        ]
        return {"running": self.running, "learnt_from": config.learnt_from, "ranks": ranks}

    async def _admission(self) -> bool:
        """Where the sidecar binds tcp: a ZAP handler that admits only the publishers' addresses."""
        config = self.config
        assert config is not None
        if config.connect or not config.publishers or not config.endpoint.startswith("tcp://"):
            return False
        assert self._ctx is not None
        addresses = await resolve(config.publishers)
        if not addresses:  # pyzmq's allow() with no address would admit everyone
            raise OSError(f"kv events: the publisher hosts {config.publishers!r} name no address")
        self._auth = AsyncioAuthenticator(self._ctx, log=logging.getLogger("cachewitness.events.zap"))
        self._auth.start()
        self._auth.allow(*addresses)
        return True

    async def close(self) -> None:
        """Close every socket."""
        for sub in self._ranks:
            await sub.close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> KvEvents:
        """Start."""
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close."""
        await self.close()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def snapshots(self) -> tuple[RankSnapshot, ...]:
        """Every rank's state now."""
        return tuple(sub.state.snapshot() for sub in self._ranks)

    async def wait_until(self, predicate: Callable[[tuple[RankSnapshot, ...]], bool], timeout: float) -> bool:
        """Wait (at most `timeout` s) until `predicate` holds for the snapshots; whether it did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            changed = self._changed
            if not any(sub.busy for sub in self._ranks) and predicate(self.snapshots()):
                return True
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    async def catch_up(self, timeout: float) -> None:
        """Fetch from each rank's replay socket what was published after the last batch received.

        A lost batch shows as a gap only when a later one arrives; before reading the state at a
        quiet moment (a case's start), ask. Bounded by `timeout` s.
        """
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(sub.catch_up() for sub in self._ranks)), max(0.0, timeout)
            )

    def mark(self) -> Marker:
        """Take a marker; call it just before sending the reset."""
        ranks = tuple(
            RankMark(
                s.state.incarnation,
                s.state.applied,
                s.state.restarts,
                s.state.unreplayed_gaps,
                s.state.extra_publishers,
            )
            for s in self._ranks
        )
        return Marker(time.time(), time.monotonic(), ranks)

    async def cleared_since(self, marker: Marker, timeout: float) -> ClearResult:
        """Wait (at most `timeout` s) until every rank cleared or restarted after `marker`.

        vLLM publishes an accepted reset's AllBlocksCleared only with its next engine step: send
        the flush request after the reset, then wait here.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        def done(_: object) -> bool:
            return all(r.cleared or r.restarted for r in self._judge(marker))

        # A clear whose batch was lost, with no batch after it, shows no gap: ask for it.
        every = self.config.catch_up_s if self.config is not None else timeout
        while not await self.wait_until(done, min(every, max(0.0, deadline - loop.time()))):
            if loop.time() >= deadline:
                return ClearResult(
                    self._judge(marker), timed_out=True, elapsed_s=time.monotonic() - marker.mono
                )
            await self.catch_up(deadline - loop.time())
        return ClearResult(self._judge(marker), timed_out=False, elapsed_s=time.monotonic() - marker.mono)

    def _judge(self, marker: Marker) -> tuple[RankClear, ...]:
        slack = self.config.clock_slack_s if self.config is not None else 0.0
        return tuple(
            judge_rank(sub.state, m, marker, slack) for sub, m in zip(self._ranks, marker.ranks, strict=True)
        )
