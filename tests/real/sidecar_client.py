"""What the real-engine tests say to the sidecar and the engines: completions, streams, resets, evidence."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

JSON = dict[str, Any]
T = TypeVar("T")
# Evidence is flushed asynchronously (docs/evidence.md: within 1 s); wait a little longer.
EVIDENCE_WAIT_S = 5.0
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=120)
FILLER = "Benchmarks start cold or they measure the cache. A sidecar writes down what it saw. "


def new_case() -> tuple[str, str]:
    """A fresh (session_id, case_id) pair so each test finds its own records."""
    tag = uuid.uuid4().hex[:12]
    return f"real-{tag}", f"case-{tag}"


def long_prompt(min_chars: int = 420) -> str:
    """A prompt that no earlier request shares a prefix with, longer than several KV blocks.

    The unique tag goes first: vLLM caches whole blocks (128 tokens on CPU) and
    llama.cpp matches prefixes, so a shared start would make a "cold" request warm.
    """
    text = f"[{uuid.uuid4().hex}] "
    while len(text) < min_chars:
        text += FILLER
    return text


def tags(session_id: str, case_id: str) -> dict[str, str]:
    """The headers that tag a forwarded request for the evidence."""
    return {"X-Session-Id": session_id, "X-Case-Id": case_id}


@dataclass(frozen=True)
class Stream:
    """A streamed answer as the client saw it: the decoded data events and the raw bytes."""

    events: list[JSON]
    raw: bytes
    done: bool


async def complete(
    s: aiohttp.ClientSession, base: str, body: JSON, headers: dict[str, str] | None = None
) -> JSON:
    """POST /v1/completions (non-streaming) and return the JSON answer (raises on non-200)."""
    async with s.post(
        f"{base}/v1/completions", json=body, headers=headers or {}, timeout=REQUEST_TIMEOUT
    ) as resp:
        text = await resp.text()
        assert resp.status == 200, f"{resp.status}: {text[:500]}"
        answer: JSON = json.loads(text)
        return answer


async def stream(
    s: aiohttp.ClientSession,
    base: str,
    body: JSON,
    headers: dict[str, str] | None = None,
    path: str = "/v1/completions",
) -> Stream:
    """POST a streaming request and read every SSE data event to the end."""
    async with s.post(
        f"{base}{path}", json={**body, "stream": True}, headers=headers or {}, timeout=REQUEST_TIMEOUT
    ) as resp:
        raw = await resp.read()
        assert resp.status == 200, f"{resp.status}: {raw[:500]!r}"
    events: list[JSON] = []
    done = False
    for block in re.split(rb"\r?\n\r?\n", raw):
        for line in block.splitlines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
            elif data:
                events.append(json.loads(data))
    return Stream(events, raw, done)


def chunk_shapes(events: list[JSON]) -> set[tuple[tuple[str, ...], int]]:
    """Each event's top-level keys and number of choices: the stream's shape without its content."""
    return {(tuple(sorted(e)), len(e.get("choices") or [])) for e in events}


async def reset(s: aiohttp.ClientSession, base: str, **fields: Any) -> tuple[int, JSON]:
    """POST /cache/reset with `fields` as the JSON body; return (status, answer)."""
    async with s.post(f"{base}/cache/reset", json=fields, timeout=REQUEST_TIMEOUT) as resp:
        return resp.status, json.loads(await resp.text())


async def cache_state(s: aiohttp.ClientSession, base: str) -> JSON:
    """GET /cache/state."""
    async with s.get(f"{base}/cache/state", timeout=REQUEST_TIMEOUT) as resp:
        text = await resp.text()
        assert resp.status == 200, f"{resp.status}: {text[:500]}"
        state: JSON = json.loads(text)
        return state


async def evidence(s: aiohttp.ClientSession, base: str, **query: str) -> list[JSON]:
    """GET /cache/evidence filtered by `query`: the records as a list."""
    async with s.get(f"{base}/cache/evidence", params=query, timeout=REQUEST_TIMEOUT) as resp:
        text = await resp.text()
        assert resp.status == 200, f"{resp.status}: {text[:500]}"
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def eventually(probe: Callable[[], Awaitable[T | None]], timeout_s: float, what: str) -> T:
    """Call `probe` until it returns something not None, bounded by `timeout_s`.

    For state that lives in another process (an engine's /slots or /metrics, the
    sidecar's evidence file) there is no event to await, so this polls.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.1)


async def observations(s: aiohttp.ClientSession, base: str, case_id: str, count: int) -> list[JSON]:
    """Wait for `count` infer.cache_observation records of `case_id`; return them in order."""

    async def probe() -> list[JSON] | None:
        """The records once there are enough of them."""
        found = await evidence(s, base, case_id=case_id, event_type="infer.cache_observation")
        return found if len(found) >= count else None

    found = await eventually(probe, EVIDENCE_WAIT_S, f"{count} observations of {case_id}")
    return sorted(found, key=lambda r: r["started_ns"])


async def verification(s: aiohttp.ClientSession, base: str, reset_id: str) -> JSON:
    """Wait for the infer.cache_verification record of `reset_id`."""

    async def probe() -> JSON | None:
        """The record once it is written."""
        found = await evidence(s, base, event_type="infer.cache_verification")
        return next((r for r in found if r.get("reset_id") == reset_id), None)

    return await eventually(probe, EVIDENCE_WAIT_S, f"verdict of reset {reset_id}")


async def cache_state_record(s: aiohttp.ClientSession, base: str, case_id: str) -> JSON:
    """Wait for the infer.cache_state record of the reset tagged `case_id`."""

    async def probe() -> JSON | None:
        """The record once it is written."""
        found = await evidence(s, base, case_id=case_id, event_type="infer.cache_state")
        return found[-1] if found else None

    return await eventually(probe, EVIDENCE_WAIT_S, f"infer.cache_state of {case_id}")


def find_key(doc: Any, key: str) -> list[Any]:
    """Every value stored under `key` anywhere in a JSON document."""
    if isinstance(doc, dict):
        return ([doc[key]] if key in doc else []) + [v for x in doc.values() for v in find_key(x, key)]
    if isinstance(doc, list):
        return [v for x in doc for v in find_key(x, key)]
    return []


async def metric_value(s: aiohttp.ClientSession, url: str, name: str) -> float | None:
    """The value of an unlabelled-or-single-series metric `name` in a Prometheus text page."""
    async with s.get(url, timeout=REQUEST_TIMEOUT) as resp:
        text = await resp.text()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)$", re.M)
    values = [float(m.group(1)) for m in pattern.finditer(text)]
    return sum(values) if values else None


async def engine_info_labels(s: aiohttp.ClientSession, base: str) -> list[dict[str, str]]:
    """The label sets of cachewitness_engine_info series whose value is 1 in the sidecar's /metrics."""
    async with s.get(f"{base}/metrics", timeout=REQUEST_TIMEOUT) as resp:
        text = await resp.text()
    found = []
    for m in re.finditer(r"^cachewitness_engine_info{([^}]*)}\s+1(?:\.0)?$", text, re.M):
        found.append(dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))))
    return found
