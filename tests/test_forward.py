"""Forwarding is transparent: headers, bodies, encodings, redirects, request ids, streams."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from tests.support.client import CLIENT_TIMEOUT
from tests.support.sidecar import SidecarFactory
from tests.support.upstream import GZIPPED, STATE


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT, auto_decompress=False) as session:
        yield session


def header_names(described: dict[str, Any]) -> list[str]:
    return [name.lower() for name, _ in described["headers"]]


async def test_query_string_reaches_upstream_byte_for_byte(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    raw = "/echo/a%2Fb?x=1&y=%2F%20&z&x=2&empty="
    async with client.get(URL(proxy + raw, encoded=True)) as response:
        described = await response.json()
    assert described["raw_path"] == raw


async def test_headers_pass_through_and_host_is_rewritten(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    headers = {"Authorization": "Bearer client-key", "X-Custom": "Value With Case", "User-Agent": "bench/1"}
    async with client.get(proxy + "/echo", headers=headers) as response:
        described = await response.json()
        assert response.headers["X-Upstream"] == "yes"
    seen = {name.lower(): value for name, value in described["headers"]}
    assert seen["authorization"] == "Bearer client-key"
    assert seen["x-custom"] == "Value With Case"
    assert seen["user-agent"] == "bench/1"
    assert seen["host"] == upstream.removeprefix("http://")


async def test_hop_by_hop_request_headers_are_dropped(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    headers = {
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "1",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Proxy-Authorization": "Basic abc",
        "X-End-To-End": "2",
    }
    async with client.get(proxy + "/echo", headers=headers) as response:
        names = header_names(await response.json())
    for dropped in ("x-hop", "keep-alive", "te", "proxy-authorization"):
        assert dropped not in names
    assert "x-end-to-end" in names


async def test_no_headers_are_added_that_the_client_did_not_send(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    async with client.post(
        proxy + "/echo",
        data=b"{}",
        headers={"Content-Type": "application/json"},
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
    ) as response:
        names = header_names(await response.json())
    assert "user-agent" not in names and "accept-encoding" not in names and "accept" not in names
    assert names.count("content-type") == 1


async def test_hop_by_hop_response_headers_are_dropped(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    async with client.get(proxy + "/hop") as response:
        assert await response.text() == "ok"
        assert "X-Private" not in response.headers
        assert "Keep-Alive" not in response.headers
        assert response.headers["X-Kept"] == "1"
        assert response.headers["Set-Cookie"] == "a=1"


async def test_large_bodies_stream_both_ways_unchanged(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    payload = os.urandom(24 * 1024 * 1024)
    async with client.post(proxy + "/mirror", data=io.BytesIO(payload)) as response:
        echoed = await response.read()
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()


async def test_chunked_request_body_is_streamed(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)

    async def parts() -> AsyncIterator[bytes]:
        for index in range(50):
            yield bytes([index]) * 10_000

    # Its own bound: a sidecar that stops forwarding the body fails here, not after aiohttp's 300 s.
    async with client.post(
        proxy + "/echo", data=parts(), timeout=aiohttp.ClientTimeout(total=30)
    ) as response:
        described = await response.json()
    assert described["body_len"] == 500_000


async def test_large_response_body_passes_unchanged(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    async with client.get(proxy + "/big?bytes=33554432") as response:
        body = await response.read()
    assert body == bytes(range(256)) * (33554432 // 256)


async def test_gzip_body_is_not_decompressed(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    async with client.get(proxy + "/gzip", headers={"Accept-Encoding": "gzip"}) as response:
        assert response.headers["Content-Encoding"] == "gzip"
        assert await response.read() == GZIPPED


async def test_redirects_are_returned_not_followed(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    async with client.get(proxy + "/redirect", allow_redirects=False) as response:
        assert response.status == 302
        assert response.headers["Location"] == "/echo"


async def test_no_request_id_is_added_by_default(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    async with client.get(proxy + "/echo") as response:
        seen = {name.lower() for name, _ in (await response.json())["headers"]}
        assert "x-request-id" not in seen and "X-Request-Id" not in response.headers


async def test_request_id_header_opts_in_to_a_generated_id_both_ways(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream, request_id_header=True)
    async with client.get(proxy + "/echo") as response:
        seen = {name.lower(): value for name, value in (await response.json())["headers"]}
        assert response.headers["X-Request-Id"] == seen["x-request-id"]
        assert len(response.headers["X-Request-Id"]) >= 16


async def test_generated_request_ids_are_distinct_across_the_random_pool(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    """Ids are cut from one urandom read per 256 requests: past a refill they stay 32 distinct hex digits."""
    proxy = await sidecar(upstream, request_id_header=True)
    ids: list[str] = []
    for _ in range(300):
        async with client.get(proxy + "/echo") as response:
            ids.append(response.headers["X-Request-Id"])
    assert len(set(ids)) == len(ids)
    assert all(len(id_) == 32 and int(id_, 16) >= 0 for id_ in ids)


async def test_request_id_from_the_client_is_kept(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    async with client.get(proxy + "/echo", headers={"X-Request-Id": "req-42"}) as response:
        seen = {name.lower(): value for name, value in (await response.json())["headers"]}
        assert seen["x-request-id"] == "req-42"


async def test_sse_events_reach_the_client_one_by_one(
    sidecar: SidecarFactory, upstream: str, upstream_app: web.Application, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    state = upstream_app[STATE]
    # The head comes before any event (the engine sends it first): the gates open only after it.
    async with asyncio.timeout(10), client.get(proxy + "/sse/paced?n=5") as response:
        assert response.headers["X-Accel-Buffering"] == "no"
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for index in range(5):
            state.gates[index].set()
            line = await asyncio.wait_for(response.content.readuntil(b"\n\n"), timeout=5)
            assert line == f'data: {{"i": {index}}}\n\n'.encode()
            # The client holds event N while the engine has not been allowed to send N+1.
            assert not state.gates[index + 1].is_set()
        assert await response.content.read() == b"data: [DONE]\n\n"


async def test_many_concurrent_streams_all_complete(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)

    async def one() -> bytes:
        async with client.get(proxy + "/sse/fast?n=200") as response:
            return await response.read()

    bodies = await asyncio.gather(*(one() for _ in range(150)))
    expected = b"".join(f'data: {{"i": {i}}}\n\n'.encode() for i in range(200)) + b"data: [DONE]\n\n"
    assert all(body == expected for body in bodies)


async def test_rewritten_stream_request_carries_its_own_content_length(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    body = b'{"model": "m", "stream": true, "messages": []}'
    async with client.post(
        proxy + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    ) as response:
        described = await response.json()
    seen = {name.lower(): value for name, value in described["headers"]}
    assert '"include_usage":true' in described["body"]
    assert int(seen["content-length"]) == described["body_len"] != len(body)
    assert "transfer-encoding" not in seen


@pytest.mark.parametrize("size", [300_000, 3_000_000])  # with the head in one write; in slices by a task
async def test_a_large_injected_stream_request_reaches_the_engine_whole(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession, size: int
) -> None:
    """A long prompt goes upstream as pieces of the client's buffer around the splice, in order."""
    proxy = await sidecar(upstream)
    head, tail = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "', b'"}]}'
    body = head + bytes(range(97, 123)) * ((size - len(head) - len(tail)) // 26) + tail
    async with client.post(
        proxy + "/v1/chat/completions", data=io.BytesIO(body), headers={"Content-Type": "application/json"}
    ) as response:
        described = await response.json()
    sent = body[:-1] + b',"stream_options":{"include_usage":true}}'
    assert described["body_sha256"] == hashlib.sha256(sent).hexdigest()
    assert int({k.lower(): v for k, v in described["headers"]}["content-length"]) == len(sent)


async def test_non_stream_inference_request_is_forwarded_byte_for_byte(
    sidecar: SidecarFactory, upstream: str, client: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream)
    body = b'{"model": "m",  "stream": false, "messages": [], "user": "u"}'
    async with client.post(
        proxy + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    ) as response:
        described = await response.json()
    assert described["body"].encode() == body


@pytest.mark.parametrize("refusal", ["422", "400"])
async def test_engine_refusing_injected_stream_options_gets_the_clients_own_request(
    sidecar: SidecarFactory,
    upstream: str,
    upstream_app: web.Application,
    client: aiohttp.ClientSession,
    refusal: str,
) -> None:
    proxy = await sidecar(upstream)
    body = b'{"model": "m", "stream": true, "prompt": "x"}'
    headers = {"Content-Type": "application/json", "X-Refuse-With": refusal}
    async with client.post(proxy + "/v1/completions", data=body, headers=headers) as response:
        assert response.status == 200
        assert (await response.read()).endswith(b"data: [DONE]\n\n")
    seen = upstream_app[STATE].seen
    assert len(seen) == 2 and "stream_options" in seen[0]["body"]
    assert seen[1]["body"].encode() == body
