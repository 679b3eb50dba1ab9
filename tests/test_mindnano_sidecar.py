"""mindnano behind the sidecar: a mindnano client passes the same, resets clear the one entry, evidence.

The client below tests mindnano's semantics the way mindnano's own prefix-cache suite
would, knowing only a base URL; it must see the same statuses and bodies (ids apart)
directly and through the sidecar.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.sim import running_sim
from tests.support.sidecar import SidecarFactory
from tests.support.sim import POLL_S, WAIT_S, event_json, fast, slow

LONG_PROMPT = "1" * 1003  # 1,024 prompt tokens


def chat(content: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    """A one-message chat request to mindnano."""
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


def without_ids(raw: bytes) -> bytes:
    """A body with its per-request `id` and `created` blanked, byte for byte otherwise."""
    raw = re.sub(rb'"id":\s*"[^"]*"', b'"id":"X"', raw)
    return re.sub(rb'"created":\s*\d+', b'"created":0', raw)


class MindnanoClient:
    """A client of mindnano's API; keeps a transcript of every answer it checked."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        """Talk to `url` (mindnano itself, or a sidecar in front of it)."""
        self.http = http
        self.url = url
        self.transcript: list[tuple[str, int, bytes]] = []

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """One request; a JSON answer is decoded, an SSE answer becomes its list of events."""
        async with self.http.request(method, self.url + path, json=body) as resp:
            raw = await resp.read()
            if resp.content_type == "text/event-stream":
                events = raw.rstrip(b"\n").split(b"\n\n")
                assert events[-1] == b"data: [DONE]", events[-1]
                data: Any = [event_json(e) for e in events[:-1]]
            else:
                data = orjson.loads(raw)
        self.transcript.append((f"{method} {path}", resp.status, without_ids(raw)))
        return resp.status, data

    async def chat(self, content: str, **extra: Any) -> dict[str, Any]:
        """A chat completion that must succeed."""
        status, data = await self.call("POST", "/v1/chat/completions", chat(content, **extra))
        assert status == 200, data
        answer: dict[str, Any] = data
        return answer

    async def cached(self, content: str, **extra: Any) -> int:
        """The cached tokens of a chat completion, checked for consistency with usage."""
        data = await self.chat(content, **extra)
        metrics, usage = data["mindnano_metrics"], data["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == metrics["cached_tokens"]
        assert metrics["cached_tokens"] + metrics["prompt_evaluated_tokens"] == usage["prompt_tokens"]
        cached: int = metrics["cached_tokens"]
        return cached

    async def wait_active(self) -> None:
        """Poll `/health` (unrecorded) until a request is active (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while True:
            async with self.http.get(self.url + "/health") as resp:
                if (await resp.json())["active"]:
                    return
            assert loop.time() < deadline, "no request ever became active"
            await asyncio.sleep(POLL_S)

    async def run(self) -> None:
        """mindnano's caching semantics, checked one by one."""
        assert await self.call("POST", "/v1/cache/clear", {}) == (200, {"cleared": True})
        assert await self.call("GET", "/health") == (200, {"status": "ok", "active": False})
        _, models = await self.call("GET", "/v1/models")
        assert [card["id"] for card in models["data"]] == ["mindnano-ling3-tiny"]

        cold = await self.chat(LONG_PROMPT, user="alice")
        assert cold["usage"]["prompt_tokens"] == 1024
        warm = await self.chat(LONG_PROMPT, user="alice")
        assert warm["mindnano_metrics"] == {"cached_tokens": 1024, "prompt_evaluated_tokens": 0}
        assert warm["choices"] == cold["choices"]
        reply = warm["choices"][0]["message"]["content"]
        continued = [
            {"role": "user", "content": LONG_PROMPT},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "请继续说明。"},
        ]
        _, data = await self.call("POST", "/v1/chat/completions", {"messages": continued, "user": "alice"})
        assert data["mindnano_metrics"]["cached_tokens"] == 1024

        await self.chat("1" * 300, user="alice")
        assert await self.cached("1" * 280 + "2" * 20, user="alice") == 256
        assert await self.cached("1" * 280 + "2" * 20, user="bob") == 0
        assert await self.cached("1" * 280 + "2" * 20, user="bob") == 321
        assert await self.cached("1" * 280 + "2" * 20, user="bob", cache_prompt=False) == 0

        status, events = await self.call(
            "POST", "/v1/chat/completions", chat("1" * 280 + "2" * 20, user="bob", stream=True)
        )
        assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["mindnano_metrics"] == {"cached_tokens": 321, "prompt_evaluated_tokens": 0}
        status, events = await self.call(
            "POST",
            "/v1/chat/completions",
            chat("1" * 300, user="bob", stream=True, stream_options={"include_usage": True}),
        )
        finish, usage_chunk = events[-2], events[-1]
        assert (
            finish["mindnano_metrics"]
            == usage_chunk["mindnano_metrics"]
            == {
                "cached_tokens": 256,
                "prompt_evaluated_tokens": 65,
            }
        )
        assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 256

        await self.chat(LONG_PROMPT)
        long = asyncio.create_task(self.call("POST", "/v1/chat/completions", chat("2" * 2979, 100_000)))
        await self.wait_active()
        assert await self.call("GET", "/health") == (200, {"status": "ok", "active": True})
        assert (await self.call("POST", "/v1/chat/completions", chat("hello")))[0] == 429
        assert (await self.call("POST", "/v1/cache/clear", {}))[0] == 429
        assert await self.call("POST", "/v1/cancel", {}) == (200, {"cancel_requested": True})
        assert (await long)[0] == 409
        assert await self.cached(LONG_PROMPT) == 0
        assert await self.call("POST", "/v1/cache/clear", {}) == (200, {"cleared": True})


@pytest.mark.parametrize("route", ["direct", "sidecar"])
async def test_a_mindnano_client_passes_alike_directly_and_through_the_sidecar(
    route: str, sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    # A twin engine gives the reference transcript: the same client, straight to mindnano.
    async with running_sim(slow("mindnano")) as engine, running_sim(slow("mindnano")) as twin:
        url = engine if route == "direct" else await sidecar(engine)
        client, reference = MindnanoClient(http, url), MindnanoClient(http, twin)
        await client.run()
        await reference.run()
    assert client.transcript == reference.transcript


# -- the sidecar's mindnano dialect ----------------------------------------------------------


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> bytes:
    """A chat completion through the sidecar that must succeed; its raw body."""
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.read()


async def observations(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    """The sidecar's `infer.cache_observation` records, oldest first."""
    async with http.get(url + "/cache/evidence", params={"event_type": "infer.cache_observation"}) as r:
        return [orjson.loads(line) for line in (await r.read()).splitlines() if line.strip()]


async def test_reset_through_the_sidecar_empties_the_entry(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with running_sim(fast("mindnano")) as engine:
        url = await sidecar(engine)
        body = chat(LONG_PROMPT, user="canary")
        await post(http, url, body)
        await post(http, url, body)
        async with http.post(url + "/cache/reset", json={"session_id": "s", "case_id": "cold"}) as resp:
            answer = await resp.json()
        await post(http, url, body)
        await post(http, url, body)
        async with http.get(url + "/cache/state") as resp:
            state = await resp.json()
        records = await observations(http, url)
    assert answer["answer"] == "acknowledged" and answer["engine"]["kind"] == "mindnano"
    assert [r["cached_tokens"] for r in records] == [0, 1024, 0, 1024]
    assert state["verdict"] == "consistent"


async def test_streams_without_injection_are_observed_from_mindnano_metrics(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with running_sim(fast("mindnano")) as engine:
        url = await sidecar(engine, inject_usage=False)
        await post(http, url, chat(LONG_PROMPT, stream=True))
        await post(http, url, chat(LONG_PROMPT, stream=True))
        records = await observations(http, url)
    assert [r["cached_tokens_source"] for r in records] == ["mindnano_metrics.cached_tokens"] * 2
    assert [r["cached_tokens"] for r in records] == [0, 1024]
    assert [r["usage_injected"] for r in records] == [False, False]


async def test_reset_refused_while_busy_is_retried_and_then_empties_the_entry(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with running_sim(slow("mindnano")) as engine:
        url = await sidecar(engine)
        await post(http, url, chat(LONG_PROMPT))
        # cache_prompt false: the running request leaves the entry to the reset alone.
        running = asyncio.create_task(post(http, url, chat("2" * 100, max_tokens=40, cache_prompt=False)))
        await MindnanoClient(http, engine).wait_active()
        async with http.post(url + "/cache/reset", json={"drain": False, "retry_seconds": 30}) as resp:
            answer = await resp.json()
        await running
        await post(http, url, chat(LONG_PROMPT))
        records = await observations(http, url)
    assert answer["answer"] == "acknowledged" and answer["attempts"] > 1
    assert answer["calls"][0]["status"] == 429 and answer["calls"][-1]["status"] == 200
    assert records[-1]["cached_tokens"] == 0
