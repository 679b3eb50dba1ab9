"""Request bodies held in bounded memory (issue 16 item 1), measured on `python -m proxy serve`."""

from __future__ import annotations

import asyncio
import hashlib
import io
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from proxy.sim import running_sim
from tests.support.metrics import Scrape
from tests.support.process import open_raw, read_until_closed, start_sidecar, stop
from tests.support.sidecar import SidecarFactory, serve_app
from tests.support.sim import chat, fast

MIB = 1024 * 1024
BODY_BYTES = 63 * MIB
CONCURRENT = 8
DEFAULT_BUDGET = 256 * MIB  # max_buffered_bytes' default
WAIT_S = 120.0  # bounds every wait; 8 x 63 MiB through a loaded 2-core machine takes seconds


def big_chat_body(size: int) -> bytes:
    """A non-stream chat request of exactly `size` bytes: one long user message."""
    head, tail = b'{"model":"m","messages":[{"role":"user","content":"', b'"}]}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM) from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def hashing_engine(expected: int) -> web.Application:
    """An engine that reads each body as it streams in, and answers (with its hash) only once
    `expected` requests are in, so every sidecar exchange is in flight at the same moment."""
    arrived: list[int] = []
    all_in = asyncio.Event()

    async def chat(request: web.Request) -> web.Response:
        digest, length = hashlib.sha256(), 0
        async for chunk in request.content.iter_any():
            digest.update(chunk)
            length += len(chunk)
        arrived.append(length)
        if len(arrived) == expected:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), timeout=WAIT_S)
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
        return web.json_response(
            {"object": "chat.completion", "usage": usage, "length": length, "sha256": digest.hexdigest()}
        )

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application(client_max_size=2 * BODY_BYTES)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app


async def test_concurrent_63_mib_bodies_stay_under_512_mb_and_are_all_answered(tmp_path: Path) -> None:
    """8 x 63 MiB at once: the budget (256 MiB) observes 4, streams 4 unobserved, RSS < 512 MiB."""
    body = big_chat_body(BODY_BYTES)
    expected_hash = hashlib.sha256(body).hexdigest()
    async with serve_app(hashing_engine(CONCURRENT)) as engine:
        process, proxy = await start_sidecar(engine, tmp_path, "--engine", "generic")
        idle_peak = peak_rss_bytes(process.pid)
        try:
            timeout = aiohttp.ClientTimeout(total=WAIT_S)
            async with aiohttp.ClientSession(timeout=timeout) as client:

                async def post() -> tuple[int, dict[str, object]]:
                    async with client.post(
                        proxy + "/v1/chat/completions",
                        data=io.BytesIO(body),
                        headers={"Content-Type": "application/json"},
                    ) as response:
                        return response.status, await response.json()

                answers = await asyncio.gather(*(post() for _ in range(CONCURRENT)))
                async with client.get(proxy + "/metrics") as response:
                    scrape = Scrape(await response.text())
            peak = peak_rss_bytes(process.pid)
        finally:
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), timeout=WAIT_S) == 0
    assert [status for status, _ in answers] == [200] * CONCURRENT
    assert all(a["length"] == BODY_BYTES and a["sha256"] == expected_hash for _, a in answers)
    assert peak < 512 * MIB, f"peak RSS {peak / MIB:.0f} MiB"
    # One copy of each observed body, nothing more: the growth stays within the budget plus
    # the streaming buffers (a parsed or joined copy of even one body would pass this).
    assert peak - idle_peak < DEFAULT_BUDGET + 48 * MIB, f"RSS grew {(peak - idle_peak) / MIB:.0f} MiB"
    assert scrape.value("cachewitness_requests_unobserved_total", reason="max_buffered_bytes") == 4
    assert scrape.value("cachewitness_buffered_request_bytes") == 0
    records = [orjson.loads(line) for line in (tmp_path / "ev.jsonl").read_bytes().splitlines()]
    observed = [r for r in records if r["event_type"] == "infer.cache_observation"]
    assert len(observed) == 4 and all(r["cached_tokens"] == 0 for r in observed)


async def test_a_body_past_the_budget_streams_through_whole_and_unobserved(
    sidecar: SidecarFactory, upstream: str, http: aiohttp.ClientSession
) -> None:
    """Known length or chunked, a body past max_buffered_bytes reaches the engine byte for byte,
    is counted and gets no observation; one that fits is observed."""
    proxy = await sidecar(upstream, max_buffered_bytes=4096)
    small = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "fits"}]})
    large = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * 20_000}]})

    async def chunked() -> AsyncIterator[bytes]:
        for offset in range(0, len(large), 1000):  # no Content-Length: the budget is taken as it comes
            yield large[offset : offset + 1000]

    seen = []
    for data in (small, large, chunked()):
        async with http.post(proxy + "/v1/chat/completions", data=data) as response:
            assert response.status == 200
            seen.append(await response.json())
    assert [s["body_sha256"] for s in seen] == [hashlib.sha256(b).hexdigest() for b in (small, large, large)]
    async with http.get(proxy + "/metrics") as response:
        scrape = Scrape(await response.text())
    assert scrape.value("cachewitness_requests_unobserved_total", reason="max_buffered_bytes") == 2
    assert scrape.value("cachewitness_buffered_request_bytes") == 0
    params = {"event_type": "infer.cache_observation"}
    async with http.get(proxy + "/cache/evidence", params=params) as response:
        observed = [orjson.loads(line) for line in (await response.read()).splitlines()]
    assert len(observed) == 1 and observed[0]["prompt_tokens"] is None  # the echo reports no usage


TRICKLERS = 4
TRICKLE_BUDGET = 4 * MIB
SENT_BYTES = 100  # what each trickler sends of its body before it stops


async def test_trickling_uploads_do_not_starve_observation_and_are_cut(tmp_path: Path) -> None:
    """Four uploads that each declare a quarter of max_buffered_bytes and send 100 bytes hold 100
    bytes each, not the whole budget: a normal request meanwhile is observed; then body_idle_timeout
    cuts the four (issue 27, M4: they used to reserve their declared length before any byte came)."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(TRICKLE_BUDGET // TRICKLERS).encode() + b"\r\n\r\n"
    )
    async with running_sim(fast("vllm")) as engine:
        process, proxy = await start_sidecar(
            engine,
            tmp_path,
            "--max-buffered-bytes",
            str(TRICKLE_BUDGET),
            "--body-idle-timeout",
            "2",
        )
        try:
            tricklers = [await open_raw(proxy, head + b"x" * SENT_BYTES) for _ in range(TRICKLERS)]
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as client:
                # Every trickler's handler is reading its body (the bytes it sent are in the budget).
                await wait_for_metric(
                    client, proxy, "cachewitness_buffered_request_bytes", TRICKLERS * SENT_BYTES
                )
                headers = {"X-Session-Id": "normal"}
                async with client.post(
                    proxy + "/v1/chat/completions", json=chat("a normal request"), headers=headers
                ) as response:
                    assert response.status == 200
                    await response.read()
                async with client.get(proxy + "/cache/evidence", params={"session_id": "normal"}) as response:
                    observed = [orjson.loads(line) for line in (await response.read()).splitlines()]
                cut = [await read_until_closed(connection) for connection in tricklers]
                async with client.get(proxy + "/metrics") as response:
                    scrape = Scrape(await response.text())
        finally:
            await stop(process)
    assert [r["event_type"] for r in observed] == ["infer.cache_observation"]
    assert observed[0]["outcome"] == "ok" and observed[0]["prompt_tokens"] is not None
    assert scrape.value("cachewitness_requests_unobserved_total", reason="max_buffered_bytes") == 0
    assert cut == [b""] * TRICKLERS  # closed without an answer
    assert scrape.value("cachewitness_connection_limit_hits_total", limit="body_idle_timeout") == TRICKLERS
    assert scrape.value("cachewitness_buffered_request_bytes") == 0


async def wait_for_metric(client: aiohttp.ClientSession, proxy: str, name: str, at_least: float) -> None:
    """Poll /metrics until the sample `name` reaches `at_least` (bounded by WAIT_S)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        async with client.get(proxy + "/metrics") as response:
            value = Scrape(await response.text()).value(name)
        if value >= at_least:
            return
        assert loop.time() < deadline, f"{name} stayed at {value}"
        await asyncio.sleep(0.05)
