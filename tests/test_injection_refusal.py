"""An engine's refusal of the injected include_usage, decided from the client's own request (issue 27, M5).

The simulator runs behind a capturing hop (tests/support/capture.py), so each test counts the chat
requests that reached the engine; the sidecar is the production one, served by serve.py's runner.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tests.support.capture import Capture, capturing
from tests.support.client import CLIENT_TIMEOUT
from tests.support.sidecar import serve_sidecar
from tests.support.sim import chat, fast, sim, words

CHAT = "/v1/chat/completions"
# The poisoned request of the security test: its error quotes `stream_options` back.
POISONED = {"model": "sim-model", "stream": True, "messages": "stream_options"}


@dataclass(frozen=True)
class Rig:
    """A sidecar in front of a capturing hop in front of the simulator."""

    url: str
    hop: Capture
    http: aiohttp.ClientSession

    def chats_at_engine(self) -> int:
        """Chat requests that reached the engine (health probes and detection left out)."""
        return sum(1 for seen in self.hop.seen if seen.method == "POST" and seen.raw_path == CHAT)

    async def stream(self) -> bytes:
        """One normal stream through the sidecar; its body (the client must get a whole stream)."""
        async with self.http.post(self.url + CHAT, json=chat(words(8), 4, stream=True)) as response:
            assert response.status == 200, await response.text()
            body = await response.read()
        assert body.endswith(b"data: [DONE]\n\n")
        return body

    async def observations(self) -> list[dict[str, Any]]:
        """The sidecar's infer.cache_observation records, oldest first."""
        async with self.http.get(
            self.url + "/cache/evidence", params={"event_type": "infer.cache_observation"}
        ) as response:
            assert response.status == 200, await response.text()
            return [orjson.loads(line) for line in (await response.read()).splitlines() if line]


@asynccontextmanager
async def rig(tmp_path: Path, *, reject_stream_options: bool = False, **overrides: Any) -> AsyncIterator[Rig]:
    """vLLM's simulator, a capturing hop, and a sidecar with `overrides` as its settings."""
    async with (
        sim(fast("vllm", reject_stream_options=reject_stream_options)) as engine,
        capturing(engine.url) as hop,
        serve_sidecar(hop.url, tmp_path, **overrides) as sidecar,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        yield Rig(sidecar.url, hop, http)


async def test_a_request_quoting_stream_options_does_not_switch_injection_off(tmp_path: Path) -> None:
    """The poisoned request fails with and without the injection: nothing is remembered."""
    async with rig(tmp_path) as r:
        async with r.http.post(r.url + CHAT, json=POISONED) as response:
            assert response.status == 400
            # The engine's answer to the client's own request, quoting the input back.
            assert "stream_options" in (await response.json())["error"]["message"]
        # Injected (refused, the word quoted), then once more as the client wrote it (refused too).
        assert r.chats_at_engine() == 2
        await r.stream()
        assert r.chats_at_engine() == 3
        poisoned, normal = await r.observations()
    assert (poisoned["status"], poisoned["usage_injected"]) == (400, False)
    # The next normal stream is still injected, and its usage read.
    assert normal["usage_injected"] is True
    assert normal["prompt_tokens"] is not None and normal["cached_tokens"] == 0


async def test_a_real_refusal_is_remembered_then_probed_again_after_the_bound(tmp_path: Path) -> None:
    """An engine refusing every stream_options: remembered, for inject_usage_reprobe_seconds only."""
    bound = 2.0
    async with rig(tmp_path, reject_stream_options=True, inject_usage_reprobe_seconds=bound) as r:
        await r.stream()
        # Injected and refused; the client's own request succeeded: the refusal is remembered.
        assert r.chats_at_engine() == 2
        await r.stream()
        assert r.chats_at_engine() == 3  # remembered: sent as written, once
        await asyncio.sleep(bound)
        await r.stream()
        assert r.chats_at_engine() == 5  # past the bound: injected again, refused, sent as written
        records = await r.observations()
    assert [(o["status"], o["usage_injected"]) for o in records] == [(200, False)] * 3
