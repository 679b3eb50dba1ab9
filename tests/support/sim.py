"""Helpers for tests that talk to the engine simulator over real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from proxy.sim import SimConfig, running_sim
from tests.support.client import CLIENT_TIMEOUT

# Long enough for any state a test waits for on a loaded 2-core machine; polling
# stops as soon as the state is reached.
WAIT_S = 10.0
POLL_S = 0.005


def fast(dialect: str, **options: Any) -> SimConfig:
    """A simulator with no prefill or decode delay."""
    return SimConfig(dialect=dialect, decode_rate=0, prefill_rate=0, **options)


def slow(dialect: str, **options: Any) -> SimConfig:
    """A simulator whose streams take a while (100 tokens/s), for requests that must be seen running."""
    return SimConfig(dialect=dialect, decode_rate=100, prefill_rate=0, **options)


def chat(content: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    """A one-message chat request body."""
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


def words(n: int, word: str = "alpha") -> str:
    """A prompt of n word tokens."""
    return " ".join(f"{word}{i}" for i in range(n))


@dataclass
class Sim:
    """A running simulator and a client session to it."""

    url: str
    http: aiohttp.ClientSession

    async def stats(self) -> dict[str, Any]:
        """GET /sim/stats."""
        async with self.http.get(self.url + "/sim/stats") as resp:
            stats: dict[str, Any] = await resp.json()
            return stats

    async def wait_stats(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Poll /sim/stats until predicate holds (bounded by WAIT_S)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        stats = await self.stats()
        while not predicate(stats):
            if loop.time() > deadline:
                raise AssertionError(f"simulator never reached the state; last stats {stats}")
            await asyncio.sleep(POLL_S)
            stats = await self.stats()
        return stats

    async def post_json(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """POST a JSON body; return status and decoded JSON."""
        async with self.http.post(self.url + path, json=body) as resp:
            return resp.status, await resp.json(content_type=None)

    async def cached(self, body: dict[str, Any], path: str = "/v1/chat/completions") -> int:
        """Cached tokens that a non-stream request reports."""
        status, data = await self.post_json(path, body)
        assert status == 200, data
        cached: int = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        return cached


@asynccontextmanager
async def sim(config: SimConfig) -> AsyncIterator[Sim]:
    """Run a simulator and a client session for one test."""
    async with running_sim(config) as url, aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
        yield Sim(url, http)


async def read_events(resp: aiohttp.ClientResponse) -> list[bytes]:
    """Read a whole SSE body and split it into raw events (without the blank-line separator)."""
    body = await resp.read()
    assert body.endswith(b"\n\n"), body[-40:]
    return body[:-2].split(b"\n\n")


def event_json(event: bytes) -> dict[str, Any]:
    """Decode one `data: {json}` event."""
    assert event.startswith(b"data: "), event
    decoded: dict[str, Any] = orjson.loads(event[len(b"data: ") :])
    return decoded


async def next_event(resp: aiohttp.ClientResponse) -> bytes:
    """Read the next SSE event (its `data: ...` line) from a streaming response."""
    line = await resp.content.readline()
    blank = await resp.content.readline()
    assert blank == b"\n", (line, blank)
    return line.rstrip(b"\n")
