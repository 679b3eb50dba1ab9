"""Engines whose answers attack the sidecar (issue 27): heads without end, stray answers, bad bytes.

The sidecar trusts the engine with what it answers, not with the sidecar's memory, its loop
or other clients' answers: an answer head past `max_upstream_head_bytes` or 100 headers is a
502 `upstream_bad_answer` (its connection closed, counted) while the sidecar keeps serving;
bytes after the end of an answer never reach the next request; and a head that cannot be
relayed unchanged is a 502, never a 500.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.client import CLIENT_TIMEOUT
from tests.support.hostile_engine import OK_JSON, hostile_engine, path_of, query_of
from tests.support.process import start_sidecar
from tests.support.sidecar import SidecarFactory

PIECE = 64 * 1024
ENDLESS = 256 * 1024 * 1024  # "endless": past anything the sidecar could hold; the engine stops when cut


async def _head_attack(head: bytes, writer: asyncio.StreamWriter) -> bool:
    """The attacks on the leg's head limits, by path; anything else is answered plainly."""
    path = path_of(head)
    if path == "/endless":  # one header value that never ends
        writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
        for _ in range(ENDLESS // PIECE):
            writer.write(b"a" * PIECE)
            await writer.drain()
    elif path == "/block":  # 100 MB of headers, then an end and a body
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for index in range(100):
            writer.write(b"X-Block-%d: " % index)
            for _ in range(1024 * 1024 // PIECE):
                writer.write(b"b" * PIECE)
                await writer.drain()
            writer.write(b"\r\n")
        writer.write(b"Content-Length: 2\r\n\r\nok")
    elif path == "/many":  # 101 small headers (Content-Length one of them)
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-H%d: %d\r\n" % (i, i) for i in range(100)))
        writer.write(b"Content-Length: 2\r\n\r\nok")
    elif path == "/hundred":  # 100 headers: at the limit, relayed
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-H%d: %d\r\n" % (i, i) for i in range(99)))
        writer.write(b"Content-Length: 2\r\n\r\nok")
    else:
        writer.write(OK_JSON)
    return True


async def _bad_answers(http: aiohttp.ClientSession, proxy: str) -> float:
    """`upstream_errors_total{kind="bad_answer"}` of the sidecar."""
    async with asyncio.timeout(10), http.get(f"{proxy}/metrics") as response:
        text = await response.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "cachewitness_upstream_errors_total" and sample.labels.get("kind") == "bad_answer"
    )


async def _healthy_until(
    done: asyncio.Task[tuple[int, dict[str, Any]]], http: aiohttp.ClientSession, proxy: str
) -> int:
    """Probe /-/healthy until `done` finishes, each probe within its own bound; how many answered."""
    probes = 0
    while True:
        async with asyncio.timeout(5), http.get(f"{proxy}/-/healthy") as response:
            assert response.status == 200
        probes += 1
        if done.done():
            return probes
        await asyncio.wait({done}, timeout=0.05)


async def test_answer_heads_past_the_leg_limits_are_502_while_the_sidecar_keeps_answering(
    tmp_path: Path,
) -> None:
    """An endless header, a 100 MB header block, 101 headers: each a 502 `upstream_bad_answer`, its
    connection closed and counted, /-/healthy answering all along (they froze the sidecar 7-13 s)."""
    async with hostile_engine(_head_attack) as engine, aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
        process, proxy = await start_sidecar(engine.url, tmp_path, "--engine", "vllm")
        try:
            for count, path in enumerate(("/endless", "/block", "/many"), start=1):

                async def attack(path: str = path) -> tuple[int, dict[str, Any]]:
                    async with http.get(f"{proxy}{path}") as response:
                        return response.status, await response.json()

                engine.cut.clear()
                attacking = asyncio.create_task(attack())
                try:
                    assert await _healthy_until(attacking, http, proxy) >= 1, path
                    status, body = await asyncio.wait_for(attacking, timeout=30)
                finally:
                    attacking.cancel()
                assert (status, body["error"]["code"]) == (502, "upstream_bad_answer"), path
                await asyncio.wait_for(engine.cut.wait(), timeout=10)  # the engine's connection was closed
                assert await _bad_answers(http, proxy) == count, path
            async with asyncio.timeout(10), http.get(f"{proxy}/hundred") as response:
                assert (response.status, await response.read()) == (200, b"ok")  # 100 headers: at the limit
                assert response.headers["X-H98"] == "98"
        finally:
            process.terminate()
            await asyncio.wait_for(process.wait(), timeout=20)


async def _reply_then_stray(head: bytes, writer: asyncio.StreamWriter) -> bool:
    """The answer to `?id=N`, and in the same write the start of a second answer for N; its end follows."""
    if path_of(head) != "/v1/tagged":
        writer.write(OK_JSON)
        return True
    tag = f"answer for {query_of(head)}".encode()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(tag), tag)
    writer.write(answer + b"HTTP/1.1 200 OK\r\nContent-Le")
    await writer.drain()
    await asyncio.sleep(0.05)  # the next client's request is on its way meanwhile
    writer.write(b"ngth: %d\r\n\r\n%b" % (len(tag), tag))
    return True


async def test_bytes_after_an_answer_never_reach_the_next_request(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """With one engine connection, each of 10 clients in turn gets its own answer, never the stray one
    (issue 27 L1: 10 of 10 got the previous request's)."""
    async with hostile_engine(_reply_then_stray) as engine:
        proxy = await sidecar(engine.url, engine="vllm", health_interval=3600, upstream_connection_limit=1)
        answers = []
        for index in range(10):
            async with asyncio.timeout(10), http.get(f"{proxy}/v1/tagged?id={index}") as response:
                answers.append((response.status, await response.read()))
    assert answers == [(200, f"answer for id={index}".encode()) for index in range(10)]


async def _odd_heads(head: bytes, writer: asyncio.StreamWriter) -> bool:
    """Answers whose reason phrase or header values are unusual, by query."""
    status_line, header = {
        "control": (b"HTTP/1.1 200 O\x01K", b""),
        "tab": (b"HTTP/1.1 200 All\tgood", b""),
        "utf8": ("HTTP/1.1 299 Très bien".encode(), "X-Name: café ☕\r\n".encode()),
        "latin1": (b"HTTP/1.1 200 OK", b"X-Name: caf\xe9\r\n"),
        "latin1-reason": (b"HTTP/1.1 200 Tr\xe8s bien", b""),
    }.get(query_of(head), (b"HTTP/1.1 200 OK", b""))
    writer.write(status_line + b"\r\n" + header + b"Content-Length: 2\r\n\r\nok")
    return True


@pytest.mark.parametrize(
    ("query", "status", "reason", "header"),
    [
        ("tab", 200, "All\tgood", None),
        ("utf8", 299, "Très bien", "café ☕".encode()),
    ],
)
async def test_a_valid_reason_phrase_and_header_value_are_relayed_unchanged(
    sidecar: SidecarFactory,
    http: aiohttp.ClientSession,
    query: str,
    status: int,
    reason: str,
    header: bytes | None,
) -> None:
    async with hostile_engine(_odd_heads) as engine:
        proxy = await sidecar(engine.url, engine="vllm", health_interval=3600)
        async with asyncio.timeout(10), http.get(f"{proxy}/v1/odd?{query}") as response:
            assert (response.status, response.reason, await response.read()) == (status, reason, b"ok")
            assert dict(response.raw_headers).get(b"X-Name") == header


@pytest.mark.parametrize("query", ["control", "latin1", "latin1-reason"])
async def test_a_reason_phrase_or_header_value_that_cannot_be_relayed_unchanged_is_502_not_500(
    sidecar: SidecarFactory, http: aiohttp.ClientSession, query: str
) -> None:
    """A control byte in the reason phrase made aiohttp fail the answer (500); a header value
    that is not UTF-8 arrived empty. Neither can go to the client as the engine sent it."""
    async with hostile_engine(_odd_heads) as engine:
        proxy = await sidecar(engine.url, engine="vllm", health_interval=3600)
        async with asyncio.timeout(10), http.get(f"{proxy}/v1/odd?{query}") as response:
            assert response.status == 502
            assert (await response.json())["error"]["code"] == "upstream_bad_answer"
        async with asyncio.timeout(10), http.get(f"{proxy}/v1/odd") as response:
            assert response.status == 200  # and the next answer is relayed


async def _trailer_attack(head: bytes, writer: asyncio.StreamWriter) -> bool:
    """A chunked answer whose trailers never end (one endless value, or 101 of them)."""
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n")
    if query_of(head) == "many":
        writer.write(b"".join(b"X-T%d: %d\r\n" % (i, i) for i in range(101)) + b"\r\n")
        return True
    writer.write(b"X-Endless: ")
    for _ in range(ENDLESS // PIECE):
        writer.write(b"t" * PIECE)
        await writer.drain()
    return True


@pytest.mark.parametrize("query", ["endless", "many"])
async def test_trailers_past_the_leg_limits_cut_the_answer(
    sidecar: SidecarFactory, http: aiohttp.ClientSession, query: str
) -> None:
    """Trailers are never relayed but still parsed, by the same code as headers: the same bounds
    hold, and past them the answer (its head already relayed) is cut, counted, its connection closed."""
    async with hostile_engine(_trailer_attack) as engine:
        proxy = await sidecar(engine.url, engine="vllm", health_interval=3600)
        async with asyncio.timeout(30), http.get(f"{proxy}/v1/trailers?{query}") as response:
            assert response.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await response.read()
        await asyncio.wait_for(engine.cut.wait(), timeout=10)
        assert await _bad_answers(http, proxy) == 1
