"""A lean SSE load generator: N keep-alive connections, each running streamed chat completions back to back.

Raw asyncio protocol on uvloop (no HTTP client library) so the load generator costs
little next to what it measures. Prints one JSON object on stdout.

    python bench/sse_load.py --url http://127.0.0.1:8000 --concurrency 64 --seconds 3 --max-tokens 256
    python bench/sse_load.py --url ... --concurrency 1000 --hold   # open streams, print "ready", wait for stdin EOF
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from array import array
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import uvloop

PATH = "/v1/chat/completions"


@dataclass
class Totals:
    """Counters shared by every connection of one run."""

    deadline: float
    events: int = 0  # SSE events received before the deadline
    streams: int = 0  # streams that ended (zero-length chunk) before the deadline
    errors: int = 0
    ttfb: array[float] = field(default_factory=lambda: array("d"))  # seconds, request sent -> first event
    gaps: array[float] = field(default_factory=lambda: array("d"))  # nonzero inter-event gaps, seconds
    zero_gaps: int = 0  # events that arrived in the same read as the one before them
    first_event: int = 0  # connections that have seen at least one event (for --hold)


class StreamConnection(asyncio.Protocol):
    """One keep-alive connection that sends a streamed request whenever the last one ended."""

    def __init__(self, request: bytes, totals: Totals, repeat: bool, done: asyncio.Future[None]) -> None:
        """Remember what to send and where to count."""
        self._request = request
        self._totals = totals
        self._repeat = repeat
        self._done = done
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._reset_state()

    def _reset_state(self) -> None:
        """Forget the previous response."""
        self._in_head = True
        self._chunk_left = -1  # -1: a chunk-size line is expected next
        self._last_byte = 0  # last body byte, to find '\n\n' across reads
        self._sent_at = 0.0
        self._last_event_at = 0.0
        self._seen_event = False
        self._buf.clear()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Send the first request."""
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        self._send()

    def _send(self) -> None:
        """Send the request and start the clock."""
        self._reset_state()
        self._sent_at = time.perf_counter()
        assert self._transport is not None
        self._transport.write(self._request)

    def connection_lost(self, exc: Exception | None) -> None:
        """The server closed the connection: count it unless we were done."""
        if not self._done.done():
            self._totals.errors += 1
            self._done.set_result(None)

    def data_received(self, data: bytes) -> None:
        """Parse the head, de-chunk the body, count events and gaps."""
        now = time.perf_counter()
        buf = self._buf
        buf += data
        if self._in_head:
            end = buf.find(b"\r\n\r\n")
            if end == -1:
                return
            head = bytes(buf[:end]).lower()
            del buf[: end + 4]
            if not head.startswith(b"http/1.1 200") or b"transfer-encoding: chunked" not in head:
                self._fail()
                return
            self._in_head = False
        events = 0
        finished = False
        while buf:
            if self._chunk_left < 0:
                line_end = buf.find(b"\r\n")
                if line_end == -1:
                    break
                size = int(bytes(buf[:line_end]).split(b";", 1)[0], 16)
                if size == 0:
                    if len(buf) < line_end + 4:
                        break  # wait for the final CRLF
                    del buf[: line_end + 4]
                    finished = True
                    break
                del buf[: line_end + 2]
                self._chunk_left = size
            if self._chunk_left == 0:
                if len(buf) < 2:
                    break
                del buf[:2]  # the CRLF after the chunk's data
                self._chunk_left = -1
                continue
            take = min(self._chunk_left, len(buf))
            piece = bytes(buf[:take])
            del buf[:take]
            self._chunk_left -= take
            events += piece.count(b"\n\n") + (1 if self._last_byte == 0x0A and piece[:1] == b"\n" else 0)
            self._last_byte = piece[-1]
        if events:
            self._count(now, events)
        if finished:
            self._stream_ended(now)

    def _count(self, now: float, events: int) -> None:
        """Record `events` events that arrived in one read at `now`."""
        totals = self._totals
        if now <= totals.deadline:
            totals.events += events
            if not self._seen_event:
                totals.ttfb.append(now - self._sent_at)
            else:
                totals.gaps.append(now - self._last_event_at)
            totals.zero_gaps += events - 1
        if not self._seen_event:
            self._seen_event = True
            totals.first_event += 1
        self._last_event_at = now

    def _stream_ended(self, now: float) -> None:
        """One stream is over: count it and start the next, or stop."""
        if now <= self._totals.deadline:
            self._totals.streams += 1
        if self._repeat and now < self._totals.deadline:
            self._send()
        else:
            if self._transport is not None:
                self._transport.close()
            if not self._done.done():
                self._done.set_result(None)

    def _fail(self) -> None:
        """A non-200 or non-chunked answer: count an error and stop this connection."""
        self._totals.errors += 1
        if self._transport is not None:
            self._transport.close()
        if not self._done.done():
            self._done.set_result(None)


def _request_bytes(url: str, max_tokens: int) -> tuple[str, int, bytes]:
    """Host, port and the raw request for one streamed chat completion."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = json.dumps(
        {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "Benchmark prompt: tell me a long story."}],
            "max_tokens": max_tokens,
            "stream": True,
        },
        separators=(",", ":"),
    ).encode()
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return host, port, head + body


def _percentile(sorted_values: list[float], zeros: int, q: float) -> float | None:
    """The q-quantile of `zeros` zeros plus `sorted_values` (nearest rank)."""
    n = zeros + len(sorted_values)
    if n == 0:
        return None
    rank = max(1, math.ceil(q * n)) - 1
    return 0.0 if rank < zeros else sorted_values[rank - zeros]


async def _open(host: str, port: int, request: bytes, totals: Totals, repeat: bool) -> asyncio.Future[None]:
    """Open one connection; its future resolves when it stops."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    try:
        await loop.create_connection(lambda: StreamConnection(request, totals, repeat, done), host, port)
    except OSError:
        totals.errors += 1
        done.set_result(None)
    return done


async def run_load(url: str, concurrency: int, seconds: float, max_tokens: int) -> dict[str, object]:
    """Run streams back to back on `concurrency` connections for `seconds`; the figures."""
    host, port, request = _request_bytes(url, max_tokens)
    start = time.perf_counter()
    totals = Totals(deadline=start + seconds)
    dones = await asyncio.gather(*(_open(host, port, request, totals, True) for _ in range(concurrency)))
    # Streams still running at the deadline finish (bounded: the engine is unthrottled).
    await asyncio.wait(dones, timeout=seconds + 30)
    ttfb = sorted(totals.ttfb)
    gaps = sorted(totals.gaps)
    return {
        "concurrency": concurrency,
        "seconds": seconds,
        "streams": totals.streams,
        "events": totals.events,
        "events_per_s": totals.events / seconds,
        "errors": totals.errors,
        "ttfb_p50_ms": _ms(_percentile(ttfb, 0, 0.50)),
        "ttfb_p99_ms": _ms(_percentile(ttfb, 0, 0.99)),
        "gap_p99_ms": _ms(_percentile(gaps, totals.zero_gaps, 0.99)),
    }


def _ms(value: float | None) -> float | None:
    """Seconds to milliseconds, rounded."""
    return round(value * 1000, 3) if value is not None else None


async def hold_open(url: str, concurrency: int, max_tokens: int, ready_timeout: float) -> dict[str, object]:
    """Open `concurrency` slow streams, say "ready" once each saw an event, hold until stdin closes."""
    host, port, request = _request_bytes(url, max_tokens)
    totals = Totals(deadline=time.perf_counter() + 3600)
    # Open in batches so the listen backlog never overflows.
    for first in range(0, concurrency, 100):
        await asyncio.gather(
            *(_open(host, port, request, totals, False) for _ in range(first, min(concurrency, first + 100)))
        )
    deadline = time.monotonic() + ready_timeout
    while totals.first_event + totals.errors < concurrency and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)  # a bench's poll of counters, bounded by the deadline
    print(json.dumps({"ready": totals.first_event, "errors": totals.errors}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    return {"open": totals.first_event, "errors": totals.errors}


def main() -> int:
    """Parse arguments, run, print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--hold", action="store_true", help="open streams and hold them until stdin closes")
    parser.add_argument("--ready-timeout", type=float, default=60.0)
    ns = parser.parse_args()
    if ns.hold:
        result = uvloop.run(hold_open(ns.url, ns.concurrency, ns.max_tokens, ns.ready_timeout))
    else:
        result = uvloop.run(run_load(ns.url, ns.concurrency, ns.seconds, ns.max_tokens))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
