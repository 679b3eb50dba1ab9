"""Helpers for the KV events tests: free port runs, a simulator that publishes, the subscriber core."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from proxy.witnesses.kv_events.state import RankSnapshot
from proxy.witnesses.kv_events.subscribers import KvEvents, KvEventsConfig
from tests.support.ports import fixed_ports
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
