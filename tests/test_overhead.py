"""The sidecar's own added time per request (proxy/observe/overhead.py), on both servers.

A deterministic engine on a raw socket takes its time where a test says (before its head,
between its head and its body, before a stream's first event), and a raw client uploads
slowly where a test says: neither the engine's time nor the client's may show up in the
sidecar's `added_in_us` / `added_out_us`. Bounds are generous (half of the delay planted);
the figures themselves are bench/paced.py's.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.support.bench_modules import bench_module
from tests.support.metrics import scrape
from tests.support.sidecar import serve_sidecar

DELAY = 0.4  # seconds the engine (or the client) takes where a test says
BOUND_US = int(DELAY / 2 * 1e6)  # the sidecar's own time stays well below it

_JSON = b'{"id":"chatcmpl-1","usage":{"prompt_tokens":3,"completion_tokens":1}}'
_EVENTS = (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b"data: [DONE]\n\n")
_JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(_JSON)
_SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(event: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(event), event)


class _Engine:
    """Answers as each request's X-Answer header says, and keeps every request head it read."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                self.heads.append(head)
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                kind = re.search(rb"(?i)x-answer: *(\w+)", head)
                await self._answer(writer, kind.group(1).decode() if kind else "json")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, kind: str) -> None:
        """json: at once; late: DELAY before the head; split: the head, DELAY, the body;
        sse: the head with its first event; sse_late: the head, DELAY, the events."""
        if kind == "late":
            await asyncio.sleep(DELAY)
        if kind.startswith("sse"):
            writer.write(_SSE_HEAD + (b"" if kind == "sse_late" else _chunk(_EVENTS[0])))
        else:
            writer.write(_JSON_HEAD + (b"" if kind == "split" else _JSON))
        await writer.drain()
        if kind in ("split", "sse_late"):
            await asyncio.sleep(DELAY)
        if kind == "split":
            writer.write(_JSON)
        elif kind == "sse_late":
            writer.write(b"".join(_chunk(event) for event in _EVENTS) + b"0\r\n\r\n")
        elif kind == "sse":
            writer.write(_chunk(_EVENTS[1]) + b"0\r\n\r\n")
        await writer.drain()


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, _Engine]]:
    state = _Engine()
    server = await asyncio.start_server(state.connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.close()


def _request(answer: str, extra: bytes = b"") -> tuple[bytes, bytes]:
    """A plain inference request's head and body (a POST with a length: the front takes it)."""
    body = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": answer.startswith("sse")}
    )
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
        b"X-Answer: %b\r\nContent-Length: %d\r\n%b\r\n" % (answer.encode(), len(body), extra)
    )
    return head, body


async def _send(url: str, pieces: list[bytes], *, pause: float = 0.0) -> bytes:
    """Send `pieces` on one connection, `pause` seconds between them; the whole answer read back."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for i, piece in enumerate(pieces):
            if i and pause:
                await asyncio.sleep(pause)
            writer.write(piece)
            await writer.drain()
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        if b"chunked" in raw.lower():
            raw += await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
        else:
            length = re.search(rb"(?i)content-length: *(\d+)", raw)
            raw += await asyncio.wait_for(reader.readexactly(int(length.group(1)) if length else 0), 10)
    finally:
        writer.close()
    return raw


async def _observations(url: str) -> list[dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(url + "/cache/evidence", params={"event_type": "infer.cache_observation"}) as response,
    ):
        assert response.status == 200
        return [orjson.loads(line) for line in (await response.read()).splitlines()]


@pytest.mark.parametrize("front", [True, False], ids=["front", "aiohttp"])
@pytest.mark.parametrize("answer", ["json", "late", "split", "sse", "sse_late"])
async def test_each_request_records_the_sidecars_added_time_and_not_the_engines(
    engine: tuple[str, _Engine], tmp_path: Path, front: bool, answer: str
) -> None:
    """Both spans on every request, front- or aiohttp-served, JSON or stream; an engine that takes
    DELAY before its head, between head and body, or before a stream's first event adds none of it."""
    url, _ = engine
    async with serve_sidecar(url, tmp_path, front=front) as sidecar:
        raw = await _send(sidecar.url, list(_request(answer)))
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
        assert "X-Cachewitness-Overhead-Us".lower().encode() not in raw.lower()  # off by default
        (record,) = await _observations(sidecar.url)
        async with aiohttp.ClientSession() as http:
            metrics = await scrape(http, sidecar.url)
            async with http.get(sidecar.url + "/cache/state") as response:
                case = (await response.json())["since_reset"]["overhead"]
    overhead = record["overhead"]
    assert set(overhead) == {"added_in_us", "added_out_us"}, record
    for span in overhead.values():
        assert isinstance(span, int) and 0 <= span < BOUND_US, overhead
    if answer in (
        "late",
        "split",
        "sse_late",
    ):  # the engine's DELAY is in the request's time, not the sidecar's
        assert (record["finished_ns"] - record["started_ns"]) / 1e3 >= DELAY * 1e6 * 0.9
    for span, value in overhead.items():  # the case's p50/p99 of its one request: that request's
        assert case[span]["requests"] == 1
        assert value <= case[span]["p50"] == case[span]["p99"] <= value * 1.04, (case, overhead)
    for direction in ("in", "out"):
        assert metrics.value("cachewitness_added_seconds_count", direction=direction) == 1
        assert metrics.value("cachewitness_added_seconds_sum", direction=direction) < BOUND_US / 1e6


@pytest.mark.parametrize("front", [True, False], ids=["front", "aiohttp"])
async def test_a_client_that_uploads_slowly_adds_nothing_to_added_in(
    engine: tuple[str, _Engine], tmp_path: Path, front: bool
) -> None:
    """The head and half the body, DELAY, the rest: the sidecar's time starts at the body's last byte."""
    url, _ = engine
    head, body = _request("json")
    half = len(body) // 2
    async with serve_sidecar(url, tmp_path, front=front) as sidecar:
        raw = await _send(sidecar.url, [head + body[:half], body[half:]], pause=DELAY)
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
        (record,) = await _observations(sidecar.url)
    assert 0 <= record["overhead"]["added_in_us"] < BOUND_US, record["overhead"]


async def test_a_body_streamed_past_the_budget_counts_from_its_last_piece(
    engine: tuple[str, _Engine], tmp_path: Path
) -> None:
    """A body past max_buffered_bytes goes to the engine as it arrives (unobserved: no record, the
    metric only): its added_in starts at its last piece, not at the start the sidecar read."""
    url, _ = engine
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * 20_000}]})
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
        b"X-Answer: json\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    async with serve_sidecar(url, tmp_path, max_buffered_bytes=4096) as sidecar:
        raw = await _send(sidecar.url, [head + body[:8192], body[8192:]], pause=DELAY)
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
        assert await _observations(sidecar.url) == []
        async with aiohttp.ClientSession() as http:
            metrics = await scrape(http, sidecar.url)
    assert metrics.value("cachewitness_requests_unobserved_total", reason="max_buffered_bytes") == 1
    assert metrics.value("cachewitness_added_seconds_count", direction="in") == 1
    assert metrics.value("cachewitness_added_seconds_sum", direction="in") < BOUND_US / 1e6


@pytest.mark.parametrize("front", [True, False], ids=["front", "aiohttp"])
async def test_the_overhead_header_is_the_clients_only_when_asked_and_never_the_engines(
    engine: tuple[str, _Engine], tmp_path: Path, front: bool
) -> None:
    """`overhead_header = true`: each answer carries X-Cachewitness-Overhead-Us, whole microseconds;
    the engine never sees that header, not even the one a client sends itself."""
    url, state = engine
    forged = b"X-Cachewitness-Overhead-Us: 1\r\n"
    for answer in ("json", "sse_late"):
        async with serve_sidecar(url, tmp_path / answer, front=front, overhead_header=True) as sidecar:
            raw = await _send(sidecar.url, list(_request(answer, extra=forged)))
            (record,) = await _observations(sidecar.url)
        (value,) = re.findall(rb"\r\nX-Cachewitness-Overhead-Us: ([^\r]*)\r\n", raw.split(b"\r\n\r\n")[0])
        assert value.isdigit() and int(value) < BOUND_US, value
        # The head's figure: the way in and the answer's way out until its head was built.
        assert int(value) >= record["overhead"]["added_in_us"]
    posted = [head for head in state.heads if head.startswith(b"POST ")]  # not the engine detection's
    assert len(posted) == 2
    assert all(b"overhead" not in head.lower() for head in state.heads), state.heads


def _bench_self_measure() -> Any:
    """bench/self_measure.py, as bench/paced.py imports it."""
    return bench_module("self_measure")


def test_the_paced_bench_reads_quantiles_from_the_buckets_as_prometheus_does() -> None:
    """Linear within the bucket the rank falls in; past the last finite bound, that bound."""
    quantile_us = _bench_self_measure().quantile_us
    buckets = ((1e-5, 0.0), (2e-5, 10.0), (5e-5, 20.0), (math.inf, 20.0))
    assert quantile_us(buckets, 0.5) == pytest.approx(20.0)
    assert quantile_us(buckets, 0.25) == pytest.approx(15.0)
    assert quantile_us(buckets, 0.75) == pytest.approx(35.0)
    assert quantile_us(((1e-5, 0.0), (math.inf, 4.0)), 0.5) == pytest.approx(10.0)
    assert quantile_us(((1e-5, 0.0), (math.inf, 0.0)), 0.5) is None


async def test_the_paced_bench_reads_a_runs_own_quantiles_from_a_live_sidecar(
    engine: tuple[str, _Engine], tmp_path: Path
) -> None:
    """Before and after a run of requests: the difference is that run's, every request counted once."""
    measure = _bench_self_measure()
    url, _ = engine
    async with serve_sidecar(url, tmp_path) as sidecar:
        await _send(sidecar.url, list(_request("json")))  # before the run: left out of it
        before = await asyncio.to_thread(measure.added_buckets, sidecar.url)
        for _ in range(5):
            await _send(sidecar.url, list(_request("json")))
        after = await asyncio.to_thread(measure.added_buckets, sidecar.url)
    assert after["in"][-1][1] - before["in"][-1][1] == 5
    figures = measure.run_quantiles(before, after)
    assert set(figures) == {f"self_{d}_{q}_us" for d in ("in", "out") for q in ("p50", "p99")}
    for value in figures.values():
        assert value is not None and 0 < value < BOUND_US
    assert figures["self_in_p50_us"] <= figures["self_in_p99_us"]
    assert measure.run_quantiles(None, after)["self_in_p50_us"] is None
