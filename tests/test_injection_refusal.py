"""An engine's refusal of the injected include_usage: learnt only from the sidecar's own probe (issue 45).

The simulator runs behind a capturing hop (tests/support/capture.py), so each test counts the chat
requests that reached the engine; the sidecar is the production one, served by serve.py's runner
(`python -m proxy serve` for the attack of issue 45).
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
from aiohttp import web

from proxy.admission import ADMISSION, Hold
from proxy.forward.injection_probe import INJECTION_PROBE
from proxy.sim.wire import error_response
from tests.support.capture import Answer, Capture, capturing
from tests.support.client import CLIENT_TIMEOUT
from tests.support.process import start_sidecar, stop
from tests.support.sidecar import injection_probes_done, serve_sidecar
from tests.support.sim import WAIT_S, chat, fast, sim, words

CHAT = "/v1/chat/completions"
# The poisoned request of the security test: its error quotes `stream_options` back.
POISONED = {"model": "sim-model", "stream": True, "messages": "stream_options"}


@dataclass(frozen=True)
class Rig:
    """A sidecar in front of a capturing hop in front of the simulator."""

    url: str
    hop: Capture
    http: aiohttp.ClientSession
    app: web.Application | None = None

    def chats_at_engine(self) -> int:
        """Chat requests that reached the engine (health probes and detection left out)."""
        return sum(1 for seen in self.hop.seen if seen.method == "POST" and seen.raw_path == CHAT)

    async def stream(self, **extra: Any) -> bytes:
        """One normal stream through the sidecar; its body (the client must get a whole stream)."""
        async with self.http.post(self.url + CHAT, json=chat(words(8), 4, stream=True, **extra)) as response:
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

    async def probes_done(self, runs: int) -> None:
        """Wait (bounded) until the sidecar's injection probe has finished `runs` probes."""
        assert self.app is not None
        await injection_probes_done(self.app, runs)


@asynccontextmanager
async def rig(
    tmp_path: Path, *, reject_stream_options: bool = False, answer: Answer | None = None, **overrides: Any
) -> AsyncIterator[Rig]:
    """vLLM's simulator, a capturing hop, and a sidecar with `overrides` as its settings."""
    async with (
        sim(fast("vllm", reject_stream_options=reject_stream_options)) as engine,
        capturing(engine.url, answer=answer) as hop,
        serve_sidecar(hop.url, tmp_path, **overrides) as sidecar,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        yield Rig(sidecar.url, hop, http, sidecar.app)


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


async def test_a_real_refusal_is_learnt_from_the_probe_then_probed_again_after_the_bound(
    tmp_path: Path,
) -> None:
    """An engine refusing every stream_options: the probe confirms it; remembered for the bound only."""
    bound = 2.0
    async with rig(tmp_path, reject_stream_options=True, inject_usage_reprobe_seconds=bound) as r:
        await r.stream()
        # Injected and refused, the client's own request sent; then the probe, both ways.
        await r.probes_done(1)
        assert r.chats_at_engine() == 4
        await r.stream()
        assert r.chats_at_engine() == 5  # remembered: sent as written, once
        await asyncio.sleep(bound)
        await r.stream()
        await r.probes_done(2)
        assert r.chats_at_engine() == 9  # past the bound: injected, refused, sent as written, probed
        records = await r.observations()
    assert [(o["status"], o["usage_injected"]) for o in records] == [(200, False)] * 3


# A body this engine reads otherwise than the sidecar (any parser differential): its
# injected form is refused as vLLM refuses stream_options on a non-stream, its own form served.
_DIFFERS = b"reads-differently"


def _refuse_differing(path: str, body: bytes) -> web.Response | None:
    if path == CHAT and _DIFFERS in body and b'"stream_options"' in body:
        return error_response(
            400, "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    return None


async def test_a_clients_refused_request_alone_never_switches_injection_off(tmp_path: Path) -> None:
    """Refused injected, served as written: only a probe may decide, and the probe is taken."""
    async with rig(tmp_path, answer=_refuse_differing) as r:
        await r.stream(user="reads-differently")
        await r.probes_done(1)
        # Injected (refused), as written (served), the probe (injected, served).
        assert r.chats_at_engine() == 3
        probe = r.hop.seen[-1].body
        assert b'"stream_options":{"include_usage":true}' in probe and b'"max_tokens":1' in probe
        await r.stream(user="reads-differently")
        await r.stream()
        # The second odd request: refused and resent, but no second probe within the interval.
        await asyncio.sleep(0.2)
        assert r.chats_at_engine() == 6 and r.app is not None and r.app[INJECTION_PROBE].runs == 1
        *odd, normal = await r.observations()
    assert [(o["status"], o["usage_injected"]) for o in odd] == [(200, False)] * 2
    assert normal["usage_injected"] is True and normal["cached_tokens"] is not None


def _refuse_probes(path: str, body: bytes) -> web.Response | None:
    """An engine that refuses the probe both ways, quoting its input (as pydantic's errors do)."""
    if b"reads-differently" in body and b'"stream_options"' in body:
        return _refuse_differing(path, body)
    if path == CHAT and b'"max_tokens":1,' in body:
        return error_response(400, f"invalid request: {body.decode()}")
    return None


async def test_a_probe_refused_both_ways_switches_nothing_off(tmp_path: Path) -> None:
    """The injected probe's error names stream_options, but the plain probe fails too: not the injection."""
    async with rig(tmp_path, answer=_refuse_probes) as r:
        await r.stream(user="reads-differently")
        await r.probes_done(1)
        assert r.chats_at_engine() == 4  # injected, as written, the probe both ways
        await r.stream()
        *_, normal = await r.observations()
    assert normal["usage_injected"] is True


# Issue 45's request (vLLM's parser, Python's json, reads `stream` false: last key wins; NaN
# kept it from orjson). The sidecar read the raw name `"stream":true`, injected, drew a 400,
# resent, and remembered a refusal that switched usage off for every client for 600 s.
ATTACK = (
    b'{"model":"sim-model","messages":[{"role":"user","content":"hi"}],'
    b'"stream":true,"str\\u0065am":false,"x":NaN}'
)
# The same without NaN, past the size orjson decodes whole: the scanner alone reads it.
LARGE_ATTACK = (
    b'{"model":"sim-model","messages":[{"role":"user","content":"' + b"hi " * 6000 + b'"}],'
    b'"stream":true,"str\\u0065am":false}'
)


async def test_the_parser_differential_request_leaves_injection_on(tmp_path: Path) -> None:
    """`python -m proxy serve`: each attack reaches the engine once, as written; the next stream is injected."""
    assert len(ATTACK) <= 120
    async with (
        sim(fast("vllm")) as engine,
        capturing(engine.url) as hop,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        process, url = await start_sidecar(hop.url, tmp_path)
        try:
            headers = {"Content-Type": "application/json"}
            for attack in (ATTACK, LARGE_ATTACK):
                async with http.post(url + CHAT, data=attack, headers=headers) as response:
                    assert response.status == 200, await response.text()
                    assert "usage" in await response.json()  # not a stream: the engine read `stream` false
            rig = Rig(url, hop, http)
            await rig.stream()
            records = await rig.observations()
        finally:
            await stop(process)
    # Each attack reached the engine once, as the client wrote it: nothing injected, nothing resent.
    assert [seen.body for seen in hop.seen if seen.raw_path == CHAT][:2] == [ATTACK, LARGE_ATTACK]
    assert rig.chats_at_engine() == 3
    *attacks, normal = records
    assert [(a["status"], a["usage_injected"]) for a in attacks] == [(200, False)] * 2
    assert normal["usage_injected"] is True and normal["cached_tokens"] == 0


async def test_the_probe_is_counted_as_unobserved_traffic_not_as_a_bypass(tmp_path: Path) -> None:
    """The probe reaches the engine's counters: the case's reconciliation counts it as the sidecar's own."""
    async with rig(tmp_path, answer=_refuse_differing) as r:
        async with r.http.post(
            r.url + "/cache/reset", json={"case_id": "case-1", "session_id": "s"}
        ) as reply:
            assert reply.status == 200, await reply.text()
        await r.stream(user="reads-differently")
        await r.probes_done(1)
        async with r.http.post(r.url + "/cache/cases/case-1/close") as reply:
            assert reply.status == 200, await reply.text()
            record = await reply.json()
    # The resent request observed, the probe's one (served) request unobserved, nothing bypassed.
    assert (record["observed"]["requests"], record["unobserved"]["requests"]) == (1, 1)
    assert record["bypass"]["requests"] == 0


async def test_the_probe_waits_at_the_drain_gate(tmp_path: Path) -> None:
    """A reset's drain holds the probe as it holds client traffic: the canary has the engine alone."""
    holding: list[web.Application] = []
    holds: list[Hold] = []

    def hold_after_the_resend(path: str, body: bytes) -> web.Response | None:
        if _DIFFERS in body and b'"stream_options"' not in body and not holds:
            holds.append(holding[0][ADMISSION].hold(WAIT_S))  # the resend is in; what follows waits
        return _refuse_differing(path, body)

    async with rig(tmp_path, answer=hold_after_the_resend) as r:
        assert r.app is not None
        holding.append(r.app)
        await r.stream(user="reads-differently")
        admission = r.app[ADMISSION]
        for _ in range(200):
            if admission.held:
                break
            await asyncio.sleep(0.05)
        assert admission.held == 1 and r.chats_at_engine() == 2  # the probe waits, unsent
        admission.release(holds[0])
        await r.probes_done(1)
        assert r.chats_at_engine() == 3
