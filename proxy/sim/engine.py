"""The simulated engine core: sequences, admission, prefill/decode timing, counters."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from proxy.sim.config import SimConfig
from proxy.sim.text import output_tokens

__all__ = ["AdmissionRefused", "Engine", "EngineHooks", "Sequence", "SequenceCancelled"]

_seq_ids = itertools.count(1)


class AdmissionRefused(Exception):
    """The engine will not take the request now (mindnano's 429); carries the answer to send."""

    def __init__(self, response: web.Response) -> None:
        """Keep the answer."""
        super().__init__(response.status)
        self.response = response


class SequenceCancelled(Exception):
    """The engine was asked to cancel this sequence (mindnano `/v1/cancel`)."""


@dataclass(eq=False)
class Sequence:
    """One request inside the engine: its prompt, its options and what it produced."""

    prompt: list[str]
    max_tokens: int
    user: str | None = None  # mindnano: the tag of the cache entry it reads and writes
    cache_prompt: bool = True
    reuse_generated_state: bool = True
    id_slot: int = -1  # llama.cpp: pin to a slot; -1 = any free slot
    priority: int = 0  # vLLM: lower runs earlier under --scheduling-policy priority
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    cached: int = 0
    output: list[str] = field(default_factory=list)  # token texts, each with its leading space
    slot: int = -1  # llama.cpp: the slot it runs on
    rank: int = 0  # vllm, sglang: the data-parallel rank it runs on (its prefix cache)
    preempted: bool = False  # vLLM reset_running_requests: blocks freed, recompute needed
    # SGLang `return_cached_tokens_details`: the request asked, and its cached tokens per tier.
    tier_details: bool = False
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)  # set by cancel()
    finished: bool = False  # decoding ran to max_tokens
    prefill_s: float = 0.0
    decode_s: float = 0.0
    _tokens: Iterator[str] | None = None

    def cancel(self) -> None:
        """Ask the engine to stop this sequence (it ends at its next step, or at once in prefill)."""
        self.cancelled.set()

    @property
    def cancel_requested(self) -> bool:
        """Whether cancel() was called."""
        return self.cancelled.is_set()

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output)

    @property
    def text(self) -> str:
        """Generated text so far."""
        return "".join(self.output)

    def kv_tokens(self) -> list[str]:
        """Prompt plus generated tokens, as a follow-up prompt would tokenize them."""
        return self.prompt + [t.strip() for t in self.output]


class EngineHooks(Protocol):
    """The engine's rules that differ by dialect: admission, cache reads and writes, stats."""

    async def admit(self, seq: Sequence) -> None:
        """Wait for room to run `seq`, or raise AdmissionRefused."""

    def release(self, seq: Sequence, completed: bool) -> None:
        """`seq` stopped running (`completed`: its generation ran to the end)."""

    def lookup(self, seq: Sequence) -> int:
        """Cached prompt tokens for `seq`, about to prefill."""

    def prefilled(self, seq: Sequence) -> None:
        """The KV of `seq`'s prompt (and output so far) exists now."""

    def decoded(self, seq: Sequence, token: str) -> None:
        """`seq` generated one more token."""

    def stats(self) -> dict[str, object]:
        """Dialect-specific members of `/sim/stats`."""


class Engine:
    """Shared state of one simulated engine: running set, waiting count, counters.

    The engine runs sequences; what differs by engine (admission, the cache) it asks
    its hooks, which each dialect passes in when it builds its engine.
    """

    def __init__(self, config: SimConfig, hooks: EngineHooks) -> None:
        """Make an idle engine that applies `hooks`' rules."""
        self.config = config
        self.hooks = hooks
        self.running: set[Sequence] = set()
        self.waiting = 0
        self.requests_total = 0
        self.completed_total = 0
        self.aborted_total = 0
        self.resets_total = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generation_tokens_total = 0
        self.metrics_scrapes_total = 0  # GET /metrics answered (the sidecar shares its fetches)
        self.started_at = time.time()
        self.restarts_total = 0  # POST /sim/restart (kept across restarts: it is the sim's own)
        self._idle = asyncio.Event()
        self._idle.set()

    def restart(self) -> None:
        """A restarted engine: its counters start from 0 again (the caches are the dialect's)."""
        self.requests_total = self.completed_total = self.aborted_total = self.resets_total = 0
        self.prompt_tokens_total = self.cached_tokens_total = self.generation_tokens_total = 0
        self.started_at = time.time()
        self.restarts_total += 1

    # -- state ---------------------------------------------------------------------------
    def is_idle(self) -> bool:
        """No request running or waiting."""
        return not self.running and self.waiting == 0

    def state_changed(self) -> None:
        """Recompute the idle event after running/waiting changed."""
        if self.is_idle():
            self._idle.set()
        else:
            self._idle.clear()

    async def wait_idle(self) -> None:
        """Return once no request runs or waits (callers bound it with a timeout)."""
        while not self.is_idle():
            await self._idle.wait()

    def stats(self) -> dict[str, object]:
        """Counters for `/sim/stats`."""
        return {
            "dialect": self.config.dialect,
            "running": len(self.running),
            "waiting": self.waiting,
            "requests_total": self.requests_total,
            "completed_total": self.completed_total,
            "aborted_total": self.aborted_total,
            "resets_total": self.resets_total,
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "metrics_scrapes_total": self.metrics_scrapes_total,
            "restarts_total": self.restarts_total,
            **self.hooks.stats(),
        }

    # -- one request ---------------------------------------------------------------------
    @asynccontextmanager
    async def session(self, seq: Sequence) -> AsyncIterator[Sequence]:
        """Admit a sequence (may wait or raise), count it running, account its end.

        Anything but a generation that ran to its end counts aborted: a client
        disconnect (CancelledError under handler_cancellation), a broken write, a cancel.
        """
        self.requests_total += 1
        await self.hooks.admit(seq)
        self.running.add(seq)
        self.state_changed()
        completed = False
        try:
            yield seq
            completed = seq.finished
        finally:
            self.running.discard(seq)
            if completed:
                self.completed_total += 1
            else:
                self.aborted_total += 1
            self.hooks.release(seq, completed)
            self.state_changed()

    async def prefill(self, seq: Sequence) -> None:
        """Look the prompt up in the cache and spend the prefill time of the rest."""
        seq.cached = self.hooks.lookup(seq)
        self.prompt_tokens_total += seq.prompt_tokens
        self.cached_tokens_total += seq.cached
        started = time.perf_counter()
        await self._compute(seq.prompt_tokens - seq.cached, seq.cancelled)
        seq.prefill_s = time.perf_counter() - started
        if seq.cancel_requested:
            # Cancelled during the prefill: no KV is kept and no token is generated.
            raise SequenceCancelled()
        self.hooks.prefilled(seq)
        seq._tokens = output_tokens(seq.prompt, seq.max_tokens)

    async def _compute(self, n_tokens: int, interrupt: asyncio.Event) -> None:
        """Spend the prefill time of n tokens, cut short by `interrupt`; just yield when instant."""
        rate = self.config.prefill_rate
        if rate > 0 and n_tokens > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(interrupt.wait(), n_tokens / rate)
        else:
            await asyncio.sleep(0)

    async def decode(self, seq: Sequence) -> AsyncGenerator[str, None]:
        """Yield the generated tokens at the configured decode rate.

        Deadlines are absolute from the start of decoding, so timer slack does not
        accumulate over a long generation.
        """
        assert seq._tokens is not None
        rate = self.config.decode_rate
        loop = asyncio.get_running_loop()
        start = loop.time()
        perf_start = time.perf_counter()
        try:
            for i, token in enumerate(seq._tokens):
                if seq.cancel_requested:
                    raise SequenceCancelled()
                if seq.preempted:
                    # vLLM reset_running_requests preempts: the sequence recomputes its
                    # whole KV (prompt + output so far) and then goes on decoding.
                    seq.preempted = False
                    await self._compute(len(seq.prompt) + len(seq.output), seq.cancelled)
                    self.hooks.prefilled(seq)
                    start = loop.time() - i / rate if rate > 0 else start
                if rate > 0:
                    delay = start + (i + 1) / rate - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if seq.cancel_requested:
                        raise SequenceCancelled()
                seq.output.append(token)
                self.generation_tokens_total += 1
                self.hooks.decoded(seq, token)
                yield token
            seq.finished = True
        finally:
            seq.decode_s = time.perf_counter() - perf_start

    async def generate(self, seq: Sequence) -> None:
        """Run decode to the end without streaming (non-stream responses)."""
        async for _ in self.decode(seq):
            pass
