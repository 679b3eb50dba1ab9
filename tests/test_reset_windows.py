"""The retry window a reset passes to the engine, through the whole sidecar (docs/reset.md).

SGLang's `POST /flush_cache?timeout=0` (flush now, do not wait for idle) goes through the
native route to the engine as it was asked; and each retry of a refused reset tells the
engine what is left of the window, never the whole window again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from proxy.reset.retry import RESET_RETRY_INTERVAL_SECONDS
from tests.support.hostile_engine import OK_JSON, hostile_engine, path_of, query_of
from tests.support.sidecar import serve_sidecar, stack
from tests.support.sim import fast

FLUSH_REFUSED = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: 20\r\n\r\nFlush cache failed.\n"
)


@pytest.mark.parametrize("mode", ["engine", "uniform"])
async def test_sglang_flush_with_timeout_zero_passes(mode: str, tmp_path: Path) -> None:
    async with stack(fast("sglang"), tmp_path, engine="sglang", native_resets=mode) as s:
        async with s.http.post(f"{s.url}/flush_cache?timeout=0") as response:
            assert response.status == 200
            assert (await response.text()).startswith("Cache flushed.")
            assert response.headers["X-Cachewitness-Answer"] in ("acknowledged", "accepted_unverified")
        status, body = await s.reset({"drain": False, "retry_seconds": 0, "verify": "none"})
    assert status == 200, body
    (call,) = body["calls"]
    assert call["url"].endswith("/flush_cache?timeout=0") and call["status"] == 200


async def test_each_retry_is_told_the_time_left_of_the_window(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """An SGLang that refuses every flush at once: each try's ?timeout= is the window less the time spent."""
    window = 2.25

    async def refuse_flushes(head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(FLUSH_REFUSED if path_of(head) == "/flush_cache" else OK_JSON)
        return True

    async with (
        hostile_engine(refuse_flushes) as engine,
        serve_sidecar(engine.url, tmp_path, engine="sglang", health_interval=3600) as sidecar,
        http.post(
            f"{sidecar.url}/cache/reset",
            json={"drain": False, "retry_seconds": window, "verify": "none"},
        ) as response,
    ):
        assert response.status == 409
        body = await response.json()
    told = [
        float(query_of(head).removeprefix("timeout="))
        for head in engine.heads
        if path_of(head) == "/flush_cache"
    ]
    assert len(told) == body["attempts"] >= 3
    assert told[0] == window
    for index, left in enumerate(told[1:], start=1):
        # At least one retry interval less for every refusal before it; never more than the window.
        assert left <= window - index * RESET_RETRY_INTERVAL_SECONDS + 0.01, told
    assert told == sorted(told, reverse=True)
