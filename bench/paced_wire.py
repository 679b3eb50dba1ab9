"""The paced load generator's wire: one keep-alive client connection, its counters, the requests it sends."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools

__all__ = ["Connection", "Tally", "host_port", "open_connection", "request_bytes"]

PATH = "/v1/chat/completions"


@dataclass
class Tally:
    """What one run counted."""

    latencies: list[float] = field(default_factory=list)  # seconds, send -> whole answer
    ttfe: list[float] = field(default_factory=list)  # seconds, send -> first event
    events: int = 0
    answers: int = 0
    errors: int = 0
    queued: int = 0  # requests that found no idle connection
    max_lag: float = 0.0  # seconds a send ran behind its schedule, at most


class Connection(asyncio.Protocol):
    """One keep-alive connection: sends a request when told, parses the answer with httptools."""

    def __init__(self, tally: Tally, on_done: Callable[[Connection], None]) -> None:
        """Remember where to count and whom to tell when an answer ends."""
        self.tally = tally
        self.on_done = on_done
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sent_at = 0.0
        self.seen_event = False
        self.last_byte = 0
        self.failed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Ready to send."""
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes
        self.opened.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        """A closed connection mid-answer is an error; a closed idle one is just gone."""
        if self.sent_at and not self.failed:
            self.tally.errors += 1
            self.failed = True
            self.on_done(self)

    def send(self, request: bytes) -> None:
        """Write one request and start its clock."""
        self.seen_event = False
        self.last_byte = 0
        self.sent_at = time.perf_counter()
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        """Feed the parser; an unparsable answer is an error and closes the connection."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._fail()

    def on_headers_complete(self) -> None:
        """A non-200 answer is an error."""
        if self.parser.get_status_code() != 200:
            self._fail()

    def on_body(self, body: bytes) -> None:
        """Count SSE events (a blank line ends one), across chunk boundaries too."""
        n = body.count(b"\n\n") + (1 if self.last_byte == 0x0A and body[:1] == b"\n" else 0)
        self.last_byte = body[-1]
        if n:
            if not self.seen_event:
                self.seen_event = True
                self.tally.ttfe.append(time.perf_counter() - self.sent_at)
            self.tally.events += n

    def on_message_complete(self) -> None:
        """One answer done: its latency, then the connection is idle again."""
        if self.failed:
            return
        self.tally.latencies.append(time.perf_counter() - self.sent_at)
        self.tally.answers += 1
        self.sent_at = 0.0
        self.on_done(self)

    def _fail(self) -> None:
        """Count an error once and drop the connection."""
        if not self.failed:
            self.failed = True
            self.tally.errors += 1
            if self.transport is not None:
                self.transport.close()
            self.on_done(self)


def request_bytes(url: str, max_tokens: int, stream: bool, prompt_bytes: int) -> bytes:
    """One raw chat completion request to `url` (`prompt_bytes`: a long prompt of words)."""
    host, port = host_port(url)
    # Words of 40 characters: the simulator's tokenizer works per word, a proxy per byte, so
    # the engine's share of the latency stays small next to what the proxies add.
    words = "longcontextpromptcacheprefixtokenblockxyz "
    content = (
        (words * (prompt_bytes // len(words) + 1))[:prompt_bytes]
        if prompt_bytes
        else "Benchmark prompt: say something short."
    )
    payload: dict[str, object] = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }
    if stream:
        payload["stream"] = True
    body = json.dumps(payload, separators=(",", ":")).encode()
    accept = "Accept: text/event-stream\r\n" if stream else ""
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"{accept}Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


async def open_connection(
    host: str, port: int, tally: Tally, on_done: Callable[[Connection], None]
) -> Connection:
    """One connected Connection."""
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(lambda: Connection(tally, on_done), host, port)
    await conn.opened
    return conn


def host_port(url: str) -> tuple[str, int]:
    """Host and port of a base URL."""
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80
