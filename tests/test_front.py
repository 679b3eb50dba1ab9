"""The front (proxy/inbound/): plain inference requests served beside aiohttp, with the same bytes and order.

Over raw sockets, so what a client gets is read byte for byte: the front's answers against
aiohttp's for the same engine answers (`front = false` serves every request on aiohttp), and
a connection's requests answered in order when the front hands the connection to aiohttp.
Each test also reads which server took each request (`served_by` on requests_total): bytes
that match prove nothing if one server took both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httptools
import orjson
import pytest

from proxy.body_budget import BODY_BUDGET
from proxy.inbound import CONNECTIONS
from tests.support.client import CLIENT_TIMEOUT
from tests.support.metrics import scrape
from tests.support.sidecar import Sidecar, serve_sidecar

_EVENTS = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b"data: [DONE]\n\n"]


_ANSWERS = {
    "json": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Engine: yes\r\nContent-Length: 69\r\n\r\n"
    b'{"id":"chatcmpl-1","usage":{"prompt_tokens":3,"completion_tokens":1}}',
    "sse": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%b\r\n" % (len(event), event) for event in _EVENTS)
    + b"0\r\n\r\n",
    # No Content-Type: aiohttp's default goes on.
    "untyped": b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nplain bytes",
    "empty": b"HTTP/1.1 204 No Content\r\nX-Engine: yes\r\n\r\n",
    "error": b'HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 29\r\n\r\n{"error":{"message":"bad"}}  ',
    # A stream whose last event has no blank line after it: the scanner holds it to the end.
    "unended": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%b\r\n" % (len(event), event) for event in (_EVENTS[0], b"data: [DONE]"))
    + b"0\r\n\r\n",
    # The same stream, each event its own write a while after the last (_engine_connection):
    # relayed piece by piece, each framed on its own.
    "paced": b"",
    # Delimited by the close: the sidecar frames it (chunked) for its keep-alive client.
    "close": b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n{"id":"closed"}',
}


# Opened by a test to let the engine's "held" answers go.
_RELEASE: asyncio.Event | None = None


async def _engine_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A deterministic engine, byte for byte: the answer each request's X-Answer header names.

    "length" answers with the size of the body it got; "held" does, once `_RELEASE` is set.
    """
    try:
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            body = await reader.readexactly(int(length.group(1)) if length else 0)
            kind = re.search(rb"(?i)x-answer: *(\w+)", head)
            answer = kind.group(1).decode() if kind else "json"
            if answer == "cut":  # promises 100 bytes, sends 10, closes
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n0123456789"
                )
                break
            if answer == "paced":
                await _pace(writer)
                continue
            if answer in ("length", "held"):
                if answer == "held" and _RELEASE is not None:
                    await _RELEASE.wait()
                said = orjson.dumps({"length": len(body)})
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(said), said))
                continue
            writer.write(_ANSWERS[answer])
            if answer == "close":
                break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _pace(writer: asyncio.StreamWriter) -> None:
    """The "sse" answer in pieces, 20 ms apart: its head, each event's chunk, the last chunk."""
    head, _, _ = _ANSWERS["sse"].partition(b"\r\n\r\n")
    pieces = [head + b"\r\n\r\n", *(b"%x\r\n%b\r\n" % (len(event), event) for event in _EVENTS), b"0\r\n\r\n"]
    for piece in pieces:
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0.02)


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    server = await asyncio.start_server(_engine_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


def _request(path: str = "/v1/chat/completions", answer: str = "json", extra: bytes = b"") -> bytes:
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": answer in ("sse", "paced", "unended"),
        }
    )
    return (
        f"POST {path} HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
        f"X-Answer: {answer}\r\nContent-Length: {len(body)}\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )


class _Answers:
    """Splits what a connection reads into whole HTTP answers (httptools frames them)."""

    def __init__(self) -> None:
        self.done: list[bytes] = []
        self._raw = bytearray()
        self._parser = httptools.HttpResponseParser(self)
        self._ended = 0

    def feed(self, data: bytes) -> None:
        self._raw += data
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        self._ended += 1

    def answers(self) -> int:
        return self._ended


async def _exchange(url: str, payload: bytes | list[bytes], answers: int) -> bytes:
    """Send `payload` on one connection (a list: each piece its own read at the sidecar);
    everything read until `answers` whole answers came."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    framer = _Answers()
    try:
        for piece in [payload] if isinstance(payload, bytes) else payload:
            writer.write(piece)
            if not isinstance(payload, bytes):
                await writer.drain()
                await asyncio.sleep(0.05)  # its own read at the sidecar
        while framer.answers() < answers:
            data = await asyncio.wait_for(reader.read(65536), 10)
            assert data, f"the connection closed after {framer.answers()} of {answers} answers"
            framer.feed(data)
    finally:
        writer.close()
    return bytes(framer._raw)


async def _served(sidecar: Sidecar) -> dict[str, int]:
    """How many forwarded requests each server took (requests_total by served_by)."""
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
        result = await scrape(http, sidecar.url)
    counts = {"front": 0, "aiohttp": 0}
    for (name, labels), value in result.samples.items():
        if name == "cachewitness_requests_total":
            counts[dict(labels)["served_by"]] += int(value)
    return counts


def _only(server: str, count: int = 1) -> dict[str, int]:
    return {"front": 0, "aiohttp": 0, server: count}


def _masked(raw: bytes) -> bytes:
    """The Date the sidecar adds is the clock's; everything else must match."""
    return re.sub(rb"Date: [^\r]*\r\n", b"Date: *\r\n", raw)


@pytest.mark.parametrize("answer", sorted(_ANSWERS))
async def test_the_front_writes_the_bytes_aiohttp_writes(engine: str, tmp_path: Path, answer: str) -> None:
    """Whichever server takes a plain request, the client reads the same bytes (the same head, the same framing)."""
    got, served = {}, {}
    for front in (True, False):
        async with serve_sidecar(engine, tmp_path / str(front), front=front) as sidecar:
            got[front] = _masked(await _exchange(sidecar.url, _request(answer=answer), 1))
            served[front] = await _served(sidecar)
    assert got[True] == got[False]
    assert got[True].startswith(b"HTTP/1.1 ")
    assert served == {True: _only("front"), False: _only("aiohttp")}


async def test_the_end_of_a_stream_the_scanner_held_back_reaches_the_client(
    engine: str, tmp_path: Path
) -> None:
    """The engine's last event comes without its blank line: the scanner keeps it until the answer ends
    (it may still be an injected usage chunk to take out), then writes it, before the last chunk."""
    async with serve_sidecar(engine, tmp_path) as sidecar:
        raw = await _exchange(sidecar.url, _request(answer="unended"), 1)
    head, _, framed = raw.partition(b"\r\n\r\n")
    assert b"\r\nTransfer-Encoding: chunked\r\n" in head + b"\r\n", head
    assert framed.endswith(b"%x\r\ndata: [DONE]\r\n0\r\n\r\n" % len(b"data: [DONE]")), framed


async def test_the_sidecars_own_answers_match_too(tmp_path: Path) -> None:
    """An engine that is not there: the front's 502 is aiohttp's 502, byte for byte but the Date."""
    got, served = {}, {}
    for front in (True, False):
        async with serve_sidecar("http://127.0.0.1:9", tmp_path / str(front), front=front) as sidecar:
            got[front] = _masked(await _exchange(sidecar.url, _request(), 1))
            served[front] = await _served(sidecar)
    assert got[True] == got[False]
    assert got[True].startswith(b"HTTP/1.1 502 Bad Gateway\r\n"), got[True]
    assert served == {True: _only("front"), False: _only("aiohttp")}


async def test_requests_of_one_connection_are_answered_in_order_across_the_hand_off(
    engine: str, tmp_path: Path
) -> None:
    """Pipelined: the front serves the first, hands the connection over at the probe, aiohttp serves the rest."""
    payload = _request() + b"GET /-/healthy HTTP/1.1\r\nHost: sidecar\r\n\r\n" + _request(answer="error")
    async with serve_sidecar(engine, tmp_path) as sidecar:
        raw = await _exchange(sidecar.url, payload, 3)
        served = await _served(sidecar)
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)
    assert statuses == [b"200", b"200", b"400"], raw
    assert served == {"front": 1, "aiohttp": 1}  # the probe is the sidecar's own route: not forwarded
    assert raw.index(b"chatcmpl-1") < raw.index(b"HTTP/1.1 200", 1) < raw.index(b'"bad"')


async def test_a_declined_request_reaches_the_engine_whole_after_a_served_one(
    engine: str, tmp_path: Path
) -> None:
    """A chunked body (the front takes only a length) after a plain request: aiohttp gets it from its first byte."""
    chunked = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nX-Answer: error\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    )
    async with serve_sidecar(engine, tmp_path) as sidecar:
        raw = await _exchange(sidecar.url, _request() + chunked + _request(), 3)
        served = await _served(sidecar)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", raw) == [b"200", b"400", b"200"], raw
    assert served == {"front": 1, "aiohttp": 2}  # the connection stays aiohttp's after the hand-off


async def test_pipelined_plain_requests_are_all_served_in_order(engine: str, tmp_path: Path) -> None:
    """Several plain requests in one write: each answered once, in the order sent (the front alone serves them)."""
    payload = b"".join(_request(answer=kind) for kind in ("json", "sse", "error", "json"))
    async with serve_sidecar(engine, tmp_path) as sidecar:
        raw = await _exchange(sidecar.url, payload, 4)
        served = await _served(sidecar)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", raw) == [b"200", b"200", b"400", b"200"], raw
    assert served == _only("front", 4)
    assert raw.index(b"[DONE]") < raw.index(b'"bad"')


async def test_a_request_in_many_reads_is_served_whole(engine: str, tmp_path: Path) -> None:
    """Head and body split at every kind of place (mid-head, at its end, mid-body), each piece its
    own read, a second request's start riding with the first one's end: both served, whole."""
    first, second = _request(answer="length"), _request(answer="length")
    head_end = first.index(b"\r\n\r\n") + 4
    pieces = [
        first[:20],
        first[20:head_end],
        first[head_end : head_end + 5],
        first[head_end + 5 :] + second[:30],
        second[30:],
    ]
    body_length = len(first) - head_end
    async with serve_sidecar(engine, tmp_path) as sidecar:
        raw = await _exchange(sidecar.url, pieces, 2)
        served = await _served(sidecar)
    assert raw.count(b'{"length":%d}' % body_length) == 2, raw
    assert served == _only("front", 2)


@pytest.mark.parametrize("front", [True, False])
async def test_keepalive_timeout_0_closes_each_connection_after_its_answer(
    engine: str, tmp_path: Path, front: bool
) -> None:
    """`keepalive_timeout = 0` means close after each response, whichever server answered."""
    async with serve_sidecar(engine, tmp_path, keepalive_timeout=0.0, front=front) as sidecar:
        host, port = sidecar.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(_request())
        raw = await asyncio.wait_for(reader.read(), 10)  # to the sidecar's close
        writer.close()
        served = await _served(sidecar)
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n") and raw.endswith(b'"completion_tokens":1}}'), raw
    assert served == _only("front" if front else "aiohttp")


async def test_an_idle_front_connection_is_closed_after_keepalive_timeout(
    engine: str, tmp_path: Path
) -> None:
    """The front keeps aiohttp's keep-alive limit: a connection idle past it is closed, and nothing is written."""
    async with serve_sidecar(engine, tmp_path, keepalive_timeout=0.5, header_timeout=30.0) as sidecar:
        host, port = sidecar.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        framer = _Answers()
        writer.write(_request())
        while framer.answers() < 1:
            framer.feed(await asyncio.wait_for(reader.read(65536), 10))
        # Closed by the sidecar: the read ends (b"") well before the 10 s bound.
        assert await asyncio.wait_for(reader.read(65536), 10) == b""
        writer.close()
        assert await _served(sidecar) == _only("front")  # the front's own keep-alive limit closed it


async def test_a_body_the_budget_cannot_take_as_it_arrives_goes_to_aiohttp_whole(
    engine: str, tmp_path: Path
) -> None:
    """Two 80 KB bodies under a 100 KB budget, arriving side by side: the front serves the first; the
    second, short of budget half-way, goes to aiohttp with every byte it sent (streamed unobserved)."""
    global _RELEASE
    _RELEASE = asyncio.Event()
    size = 80 * 1024

    def head(answer: str) -> bytes:
        return (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nX-Answer: {answer}\r\n"
            f"Content-Length: {size}\r\n\r\n"
        ).encode()

    async with serve_sidecar(engine, tmp_path, max_buffered_bytes=100 * 1024) as sidecar:
        host, port = sidecar.url.removeprefix("http://").split(":")
        first = await asyncio.open_connection(host, int(port))
        second = await asyncio.open_connection(host, int(port))
        first[1].write(head("held") + b"a" * 10_000)
        second[1].write(head("length") + b"b" * 10_000)
        await asyncio.sleep(0.2)  # both heads taken, 10 KB each of the budget
        first[1].write(b"a" * (size - 10_000))  # all in: served, its budget held until its answer
        await asyncio.sleep(0.2)
        second[1].write(b"b" * (size - 10_000))  # past the budget: handed to aiohttp
        answers = []
        for reader, _ in (second, first):
            framer = _Answers()
            while framer.answers() < 1:
                framer.feed(await asyncio.wait_for(reader.read(65536), 10))
                _RELEASE.set()  # the first's answer goes once the second's came
            answers.append(bytes(framer._raw))
        budget = sidecar.app[BODY_BUDGET]
        # Both answered: nothing is in progress (the front's count of the second ended when aiohttp
        # took it, or shutdown would wait the grace period for it).
        guard = sidecar.app[CONNECTIONS]
        for _ in range(50):
            if guard.requests_in_progress == 0:
                break
            await asyncio.sleep(0.1)
        in_progress = guard.requests_in_progress
        for _, writer in (first, second):
            writer.close()
        served = await _served(sidecar)
    assert in_progress == 0
    assert all(answer.startswith(b"HTTP/1.1 200 ") for answer in answers), answers
    assert all(answer.endswith(b'{"length":%d}' % size) for answer in answers), answers
    assert budget.unobserved_total == 1  # the second: streamed past the budget, by aiohttp
    assert served == {"front": 1, "aiohttp": 1}


async def test_an_answer_the_engine_cuts_is_cut_for_the_client_too(engine: str, tmp_path: Path) -> None:
    """The engine closes mid-body: both servers relay the head and what came, then cut the client (never a
    complete-looking answer), and record the request as an upstream error."""
    got, outcomes, served = {}, {}, {}
    for front in (True, False):
        async with serve_sidecar(engine, tmp_path / str(front), front=front) as sidecar:
            host, port = sidecar.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(_request(answer="cut"))
            got[front] = _masked(await asyncio.wait_for(reader.read(), 10))  # to the cut
            writer.close()
            served[front] = await _served(sidecar)
        evidence = (tmp_path / str(front) / "evidence" / "cachewitness.jsonl").read_text().splitlines()
        records = [orjson.loads(line) for line in evidence]
        outcomes[front] = [r["outcome"] for r in records if r.get("event_type") == "infer.cache_observation"]
    assert got[True] == got[False]
    assert got[True].endswith(b"\r\n\r\n0123456789"), got[True]
    assert outcomes == {True: ["upstream_error"], False: ["upstream_error"]}
    assert served == {True: _only("front"), False: _only("aiohttp")}


_DECLINED = {
    "two lengths": _request().replace(b"Content-Length:", b"Content-Length: 5\r\nContent-Length:", 1),
    "a length that is not a number": _request().replace(b"Content-Length: ", b"Content-Length: +", 1),
    "chunked": b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "a header that is not UTF-8": _request(extra=b"X-Note: caf\xe9\r\n"),
    "HTTP/1.0": _request().replace(b"HTTP/1.1", b"HTTP/1.0", 1),
    "a query": _request(path="/v1/chat/completions?x=1"),
    "an escape": _request(path="/v1/chat/%63ompletions"),
    "a dot segment": _request(path="/v1/./chat/completions"),
    "no length": b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\nX-Answer: json\r\n\r\n",
    "a control route": _request(path="/reset_prefix_cache"),
    "a GET": b"GET /v1/models HTTP/1.1\r\nHost: s\r\nX-Answer: json\r\n\r\n",
    # httptools raises HttpParserUpgrade for these (issue 45): aiohttp's, as before the front.
    "an Upgrade": _request(extra=b"Connection: Upgrade\r\nUpgrade: websocket\r\n"),
    "a CONNECT": b"CONNECT engine:443 HTTP/1.1\r\nHost: engine:443\r\n\r\n",
    # Heads aiohttp refuses or that HTTP/1.1 forbids (issue 45): aiohttp's, whole or not.
    "HTTP/1.1 without Host": _request().replace(b"Host: sidecar\r\n", b"", 1),
    "two Hosts": _request(extra=b"Host: other\r\n"),
    "a 20 KB value": _request(extra=b"X-Note: " + b"n" * 20_000 + b"\r\n"),
    "1,000 headers": _request(extra=b"".join(b"X-N%d: n\r\n" % i for i in range(1000))),
}


@pytest.mark.parametrize("case", sorted(_DECLINED))
async def test_a_head_the_front_declines_is_answered_as_aiohttp_answers_it(
    engine: str, tmp_path: Path, case: str
) -> None:
    """Each request the front leaves to aiohttp gets the very bytes it gets with the front off."""
    got, served = {}, {}
    for front in (True, False):
        async with serve_sidecar(engine, tmp_path / str(front), front=front) as sidecar:
            host, port = sidecar.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(_DECLINED[case] + b"GET /-/healthy HTTP/1.1\r\nHost: s\r\nConnection: close\r\n\r\n")
            got[front] = _masked(await asyncio.wait_for(reader.read(), 10))
            writer.close()
            served[front] = await _served(sidecar)
    assert got[True] == got[False]
    assert got[True].startswith(b"HTTP/1."), got[True]
    assert served[True] == served[False] and served[True]["front"] == 0, served


async def test_a_pipelining_client_is_read_no_further_than_a_bound_while_its_request_is_served(
    engine: str, tmp_path: Path
) -> None:
    """While one request waits on the engine, the bytes the client sends after it are kept up to a
    bound, then no longer read: they wait in the client's own buffers, not in the sidecar's memory."""
    global _RELEASE
    _RELEASE = asyncio.Event()
    later = 96 * 1024 * 1024  # past the kernel's buffers on both sides (tcp_rmem's max is 32 MiB here)
    async with serve_sidecar(engine, tmp_path) as sidecar:
        host, port = sidecar.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(_request(answer="held"))
            await asyncio.sleep(0.2)  # the head and body taken: the request is being served
            writer.write(b"x" * later)  # what would be the client's later requests
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(writer.drain(), 3)  # read at once when unbounded
            taken = later - writer.transport.get_write_buffer_size()
            _RELEASE.set()
            framer = _Answers()
            while framer.answers() < 1:
                framer.feed(await asyncio.wait_for(reader.read(65536), 10))
        finally:
            writer.transport.abort()
    assert taken < later // 2, taken
    assert bytes(framer._raw).startswith(b"HTTP/1.1 200 OK\r\n")  # the request held is answered


async def test_a_client_gone_mid_exchange_is_not_watched_after_it(engine: str, tmp_path: Path) -> None:
    """A client that leaves while its request is served: once the cancelled exchange ends, no deadline
    keeps the connection (an idle keep-alive deadline armed then held each for keepalive_timeout:
    the soak's RSS grew with every such client)."""
    global _RELEASE
    _RELEASE = asyncio.Event()  # the engine holds its answer: the client leaves first
    async with serve_sidecar(engine, tmp_path, keepalive_timeout=300.0) as sidecar:
        host, port = sidecar.url.removeprefix("http://").split(":")
        _reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(_request(answer="held"))
        await asyncio.sleep(0.3)  # served: its exchange waits on the engine
        writer.close()
        watchdog = sidecar.app[CONNECTIONS].watchdog
        for _ in range(50):  # 5 s: a few of the watchdog's 1 s ticks
            if not len(watchdog):
                break
            await asyncio.sleep(0.1)
        assert len(watchdog) == 0
        _RELEASE.set()


async def test_who_serves_each_request_and_why_is_logged_at_debug(
    engine: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At debug level each request's server and the reason are logged: the rule that sent it there."""
    caplog.set_level(logging.DEBUG, logger="cachewitness.front")
    async with serve_sidecar(engine, tmp_path) as sidecar:
        await _exchange(sidecar.url, _request() + _DECLINED["a control route"], 2)
    chosen = [
        (r.__dict__["served_by"], r.__dict__["reason"])
        for r in caplog.records
        if r.getMessage().startswith("request served by")
    ]
    assert [by for by, _ in chosen] == ["front", "aiohttp"], chosen
    assert chosen[1][1] == "a route the route policy does not forward as it is", chosen
