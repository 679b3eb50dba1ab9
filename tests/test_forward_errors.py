"""Failures on either side get clear OpenAI-style errors, and the proxy keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support.client import CLIENT_TIMEOUT
from tests.support.sidecar import SidecarFactory, free_port
from tests.support.upstream import STATE


async def still_serves(http: aiohttp.ClientSession, proxy: str) -> None:
    async with http.get(proxy + "/-/healthy") as response:
        assert response.status == 200


async def assert_openai_error(response: aiohttp.ClientResponse, status: int) -> dict[str, Any]:
    assert response.status == status
    assert response.content_type == "application/json"
    body = await response.json()
    assert set(body["error"]) >= {"message", "type", "code"}
    error: dict[str, Any] = body["error"]
    return error


async def test_unreachable_upstream_is_502(sidecar: SidecarFactory, http: aiohttp.ClientSession) -> None:
    proxy = await sidecar(f"http://127.0.0.1:{free_port()}")
    async with http.get(proxy + "/v1/models") as response:
        error = await assert_openai_error(response, 502)
    assert "refused" in error["message"]
    await still_serves(http, proxy)


async def test_upstream_that_drops_the_connection_is_502(
    sidecar: SidecarFactory, upstream: str, http: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    async with http.get(proxy + "/cut") as response:
        await assert_openai_error(response, 502)
    await still_serves(http, proxy)


async def test_upstream_silent_past_read_timeout_is_504(
    sidecar: SidecarFactory, upstream: str, http: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream, read_timeout=0.3)
    async with http.get(proxy + "/slow?s=30") as response:
        await assert_openai_error(response, 504)
    await still_serves(http, proxy)


async def test_upstream_cut_mid_body_cuts_the_client_too(
    sidecar: SidecarFactory, upstream: str, http: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    async with http.get(proxy + "/cut-mid-body") as response:
        assert response.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    await still_serves(http, proxy)


async def test_declared_body_over_limit_is_413(
    sidecar: SidecarFactory, upstream: str, upstream_app: web.Application, http: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream, max_body_bytes=1000)
    async with http.post(proxy + "/echo", data=b"x" * 1001) as response:
        await assert_openai_error(response, 413)
    assert upstream_app[STATE].seen == []
    await still_serves(http, proxy)


async def test_chunked_body_over_limit_is_413(
    sidecar: SidecarFactory, upstream: str, http: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream, max_body_bytes=100_000)

    async def parts() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b"y" * 10_000

    async with http.post(proxy + "/echo", data=parts()) as response:
        await assert_openai_error(response, 413)
    await still_serves(http, proxy)


async def test_body_at_the_limit_passes(
    sidecar: SidecarFactory, upstream: str, http: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream, max_body_bytes=1000)
    async with http.post(proxy + "/echo", data=b"x" * 1000) as response:
        assert (await response.json())["body_len"] == 1000


async def test_malformed_http_gets_400_and_proxy_keeps_serving(
    sidecar: SidecarFactory, upstream: str, http: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    host, port = proxy.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GARBAGE \x00\x01 NOT-HTTP\r\n\r\n")
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout=5)
    writer.close()
    assert status_line.split()[1] == b"400"
    await still_serves(http, proxy)


async def test_client_leaving_mid_stream_closes_the_upstream_request(
    sidecar: SidecarFactory, upstream: str, upstream_app: web.Application
) -> None:
    proxy = await sidecar(upstream)
    state = upstream_app[STATE]
    session = aiohttp.ClientSession(timeout=CLIENT_TIMEOUT)
    response = await session.get(proxy + "/sse/endless")
    assert await response.content.readuntil(b"\n\n") == b"data: first\n\n"
    await asyncio.wait_for(state.started.wait(), timeout=5)
    response.close()
    await session.close()
    # The engine side sees its request cancelled: the sequence is aborted.
    await asyncio.wait_for(state.disconnected.wait(), timeout=5)


async def test_client_leaving_before_the_answer_closes_the_upstream_request(
    sidecar: SidecarFactory, upstream: str, upstream_app: web.Application
) -> None:
    proxy = await sidecar(upstream)
    state = upstream_app[STATE]
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        task = asyncio.create_task(session.get(proxy + "/slow"))
        await asyncio.wait_for(state.started.wait(), timeout=5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await asyncio.wait_for(state.disconnected.wait(), timeout=5)
    assert not state.finished.is_set()


async def test_requests_the_sidecar_turns_away_are_counted_but_not_as_engine_errors(
    sidecar: SidecarFactory, upstream: str, http: aiohttp.ClientSession
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    proxy = await sidecar(upstream, max_body_bytes=10)
    async with http.post(proxy + "/v1/chat/completions", data=b"x" * 11) as response:
        assert response.status == 413
    async with http.get(proxy + "/metrics") as response:
        text = await response.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("cachewitness_")
    }
    assert (
        samples[
            (
                "cachewitness_requests_total",
                (("code", "4xx"), ("route", "/v1/chat/completions"), ("served_by", "aiohttp")),
            )
        ]
        == 1
    )
    assert all(
        value == 0 for (name, _), value in samples.items() if name == "cachewitness_upstream_errors_total"
    )
