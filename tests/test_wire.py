"""The aiohttp internals proxy/inbound/wire.py leans on, pinned: an aiohttp upgrade that changes one fails here.

The front writes the head bytes aiohttp would write (tests/test_front.py compares whole
responses); these tests name the internal each of those bytes comes from, so a failure says
which one moved: the header serializer, the empty-body rules, the Date and Server values, and
the held head (`_send_headers_immediately`, `send_headers`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy.inbound.wire import HeldHeadResponse, response_head, send_held_head, sidecar_response
from tests.support.sidecar import serve_app


def test_the_header_serializer_writes_the_status_line_and_each_header_as_given() -> None:
    headers = CIMultiDict([("Content-Type", "application/json"), ("X-Two", "a"), ("X-Two", "b")])
    head, chunked = response_head(
        "POST", 200, "OK", headers, keep_alive=True
    )  # Content-Length absent: chunked
    assert chunked
    assert re.fullmatch(
        rb"HTTP/1\.1 200 OK\r\nContent-Type: application/json\r\nX-Two: a\r\nX-Two: b\r\n"
        rb"Transfer-Encoding: chunked\r\nDate: [A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT\r\n"
        rb"Server: Python/3\.\d+ aiohttp/\d+\.\d+\.\d+\r\n\r\n",
        head,
    ), head


@pytest.mark.parametrize(
    ("method", "status", "empty"),
    [
        ("POST", 204, True),
        ("POST", 304, True),
        ("HEAD", 200, True),
        ("POST", 200, False),
        ("POST", 101, True),
    ],
)
def test_the_empty_body_rules(method: str, status: int, empty: bool) -> None:
    """A body that must be empty gets no framing and loses Transfer-Encoding; another gets its length."""
    headers = CIMultiDict([("Content-Length", "2"), ("Transfer-Encoding", "chunked")])
    head, chunked = response_head(method, status, "X", headers, keep_alive=False)
    assert not chunked
    assert (b"Transfer-Encoding" in head) is not empty
    assert b"Connection: close\r\n" in head


def test_the_sidecars_own_response_is_its_head_and_body() -> None:
    response = web.json_response({"error": "x"}, status=503)
    raw = sidecar_response("POST", response, keep_alive=True)
    assert raw.startswith(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
    )
    assert raw.endswith(b'\r\n\r\n{"error": "x"}') and b"Content-Length: 14\r\n" in raw


_RELEASE: asyncio.Event | None = None


async def _held(request: web.Request) -> web.StreamResponse:
    """prepare(), then the head held until the test releases it; `?first=` goes with it."""
    response = HeldHeadResponse(status=200)
    response.headers["Content-Length"] = str(len(request.query.get("first", "")))
    writer = await response.prepare(request)
    assert writer is not None and _RELEASE is not None
    await _RELEASE.wait()
    await send_held_head(response, writer, request.query.get("first", "").encode())
    await response.write_eof()
    return response


@pytest.fixture
async def held_url() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/", _held)
    async with serve_app(app, "127.0.0.1", 0) as url:
        yield url


@pytest.mark.parametrize("first", ["", "hi"])
async def test_a_held_head_waits_for_its_first_bytes_and_goes_with_them(held_url: str, first: str) -> None:
    """After prepare() nothing is written (aiohttp honours `_send_headers_immediately = False`);
    the head then goes with the first bytes, or alone through the writer's `send_headers`."""
    global _RELEASE
    _RELEASE = asyncio.Event()
    host, port = held_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET /?first={first} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    with pytest.raises(TimeoutError):  # prepared, held: not a byte yet
        await asyncio.wait_for(reader.read(1), 0.3)
    _RELEASE.set()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n") and raw.endswith(b"\r\n\r\n" + first.encode()), raw
