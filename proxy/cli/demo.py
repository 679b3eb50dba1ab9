"""`cachewitness demo`: the simulator behind the sidecar, a benchmark-like session, a report."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from proxy.config import Settings
from proxy.evidence.summary import CaseSummary, summarize, summary_table
from proxy.serve import serving
from proxy.sim import SimConfig, running_sim

__all__ = ["run_demo"]

PROMPT = (
    "You are a careful assistant. Summarise the history of the printing press in Europe, "
    "its spread after Gutenberg, and its effect on literacy, science and religion. "
) * 4
SESSION = "demo"


@asynccontextmanager
async def _sidecar(upstream: str, evidence: Path) -> AsyncIterator[str]:
    """The sidecar app on a free loopback port, the way `cachewitness serve` runs it."""
    settings = Settings(upstream=upstream, listen="127.0.0.1:0", evidence=str(evidence), health_interval=0.2)
    async with serving(settings) as url:
        yield url


class Session:
    """A benchmark client that knows only the sidecar's base URL and reset URL."""

    def __init__(self, http: aiohttp.ClientSession, base: str) -> None:
        self.http = http
        self.base = base
        self.lines: list[str] = []

    def say(self, line: str) -> None:
        """Print a line of the report as it happens."""
        print(line, flush=True)
        self.lines.append(line)

    async def chat(
        self, case: str, max_tokens: int = 8, stream: bool = False, **extra: Any
    ) -> dict[str, Any]:
        """One chat completion tagged with the case; returns the usage the client saw."""
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "stream": stream,
            **extra,
        }
        headers = {"X-Session-Id": SESSION, "X-Case-Id": case}
        async with self.http.post(self.base + "/v1/chat/completions", json=body, headers=headers) as response:
            raw = await response.read()
        if stream:
            return {"events": raw.count(b"data: ")}
        return orjson.loads(raw).get("usage") or {}

    async def reset(self, case: str, **options: Any) -> dict[str, Any]:
        """`POST /cache/reset` for a case."""
        async with self.http.post(
            self.base + "/cache/reset", json={"session_id": SESSION, "case_id": case, **options}
        ) as response:
            answer: dict[str, Any] = await response.json()
            answer["http_status"] = response.status
            return answer

    async def wait_ready(self, bound_s: float = 10) -> None:
        """Wait (bounded) until the sidecar reports the engine ready."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound_s
        while loop.time() < deadline:
            async with self.http.get(self.base + "/-/ready") as response:
                if response.status == 200:
                    return
            await asyncio.sleep(0.05)
        raise RuntimeError("the sidecar never became ready")


def _cached(usage: dict[str, Any]) -> str:
    details = usage.get("prompt_tokens_details") or {}
    return f"{details.get('cached_tokens')} of {usage.get('prompt_tokens')} prompt tokens cached"


def _reset_line(answer: dict[str, Any]) -> str:
    drain = answer.get("drain") or {}
    if drain.get("enabled"):
        drained = (
            f"drain waited {drain.get('waited_s', 0):.2f}s for {drain.get('inflight_at_start', 0)} in-flight"
        )
    else:
        drained = f"no drain, {drain.get('inflight_at_start', 0)} in flight"
    return (
        f"HTTP {answer['http_status']} answer={answer.get('answer')} attempts={answer.get('attempts')}, "
        f"{drained}, verified={answer.get('verified')}"
    )


def _canary_line(answer: dict[str, Any]) -> str:
    """What the reset's canary proved, in the engine's numbers."""
    verification = answer.get("verification") or {}
    return f"canary ({verification.get('elapsed_s', 0) * 1000:.0f} ms): {verification.get('reason')}"


async def _script(s: Session) -> None:
    """The scripted session a benchmark would run."""
    s.say("1. warm-up: the same prompt twice")
    s.say(f"   first : {_cached(await s.chat('warmup'))}")
    s.say(f"   second: {_cached(await s.chat('warmup'))}")

    s.say("2. reset WITHOUT drain while a long stream runs: the engine refuses, the sidecar retries")
    long_stream = asyncio.create_task(s.chat("background", max_tokens=60, stream=True))
    await asyncio.sleep(0.3)  # let the stream start decoding
    s.say(f"   {_reset_line(await s.reset('undrained', drain=False, retry_seconds=10))}")
    await long_stream

    s.say("3. reset WITH drain while a long stream runs: the sidecar waits, the engine acknowledges at once,")
    s.say("   and a canary proves the reset inside the drain window")
    long_stream = asyncio.create_task(s.chat("background", max_tokens=60, stream=True))
    await asyncio.sleep(0.3)
    answer = await s.reset("cold-case", drain=True)
    s.say(f"   {_reset_line(answer)}")
    s.say(f"   {_canary_line(answer)}")
    await long_stream

    s.say("4. the cold case: the same prompt twice after the reset")
    s.say(f"   first : {_cached(await s.chat('cold-case'))}  <- decides the verdict")
    s.say(f"   second: {_cached(await s.chat('cold-case'))}")
    async with s.http.get(s.base + "/cache/state") as response:
        state = await response.json()
    s.say(
        f"   /cache/state verified: {state.get('verified')} (the canary), verdict: {state.get('verdict')} (the traffic)"
    )


async def _session_records(http: aiohttp.ClientSession, base: str) -> list[bytes]:
    """The demo session's evidence lines from one sidecar."""
    async with http.get(base + "/cache/evidence", params={"session_id": SESSION}) as response:
        return (await response.read()).splitlines()


async def _ram_cache_scene(tmp: Path) -> list[bytes]:
    """The witness at work: llama.cpp acknowledges an erase its RAM prompt cache survives."""
    print(
        "\n5. llama.cpp with its host-RAM prompt cache on (the default --cache-ram): erase is not a full reset"
    )
    sim = SimConfig(
        dialect="llamacpp", decode_rate=0, prefill_rate=0, slot_save_path=str(tmp), ram_cache=True
    )
    async with running_sim(sim) as engine, _sidecar(engine, tmp / "llamacpp.jsonl") as base:
        async with aiohttp.ClientSession() as http:
            session = Session(http, base)
            await session.wait_ready()
            await session.chat("ram-warm")
            answer = await session.reset("ram-cold")
            session.say(f"   {_reset_line(answer)}  <- the engine acknowledged; the canary says otherwise")
            session.say(f"   {_canary_line(answer)}")
            session.say(f"   hint: {answer.get('hint')}")
            session.say(f"   first request after it: {_cached(await session.chat('ram-cold'))}")
            async with http.get(base + "/cache/state") as response:
                state = await response.json()
            session.say(
                f"   /cache/state verified: {state.get('verified')}, verdict: {state.get('verdict')}"
                "  <- both witnesses: the reset did not clear what it claimed"
            )
            return await _session_records(http, base)


async def _mindnano_scene(tmp: Path) -> list[bytes]:
    """mindnano: one cache entry for everyone, tagged with its user; a reset retried past its 429s."""
    print("\n6. mindnano: one cache entry for everyone, tagged with its `user`; 429 while busy")
    sim = SimConfig(dialect="mindnano", decode_rate=40, prefill_rate=0)
    async with running_sim(sim) as engine, _sidecar(engine, tmp / "mindnano.jsonl") as base:
        async with aiohttp.ClientSession() as http:
            session = Session(http, base)
            await session.wait_ready()
            session.say(f"   alice      : {_cached(await session.chat('mn-warm', user='alice'))}")
            session.say(
                f"   alice again: {_cached(await session.chat('mn-warm', user='alice'))}"
                "  <- exact repeat: saved state reused"
            )
            session.say(f"   bob, same  : {_cached(await session.chat('mn-warm', user='bob'))}")
            session.say(
                f"   alice again: {_cached(await session.chat('mn-warm', user='alice'))}"
                "  <- bob's request replaced the one entry"
            )
            # cache_prompt false: the busy request leaves alice's entry for the reset to clear.
            long_stream = asyncio.create_task(
                session.chat("mn-background", max_tokens=60, stream=True, cache_prompt=False)
            )
            await asyncio.sleep(0.3)  # let the stream start decoding
            answer = await session.reset("mn-cold", drain=False, retry_seconds=10)
            session.say(f"   reset while busy: {_reset_line(answer)}  <- 429 until the stream ended")
            await long_stream
            session.say(f"   after the reset : {_cached(await session.chat('mn-cold', user='alice'))}")
            async with http.get(base + "/cache/state") as response:
                state = await response.json()
            session.say(f"   /cache/state verdict: {state.get('verdict')}")
            return await _session_records(http, base)


async def _demo() -> int:
    with tempfile.TemporaryDirectory(prefix="cachewitness-demo-") as tmp:
        evidence = Path(tmp) / "cachewitness.jsonl"
        sim = SimConfig(dialect="vllm", decode_rate=40, prefill_rate=20000)
        async with running_sim(sim) as engine, _sidecar(engine, evidence) as base:
            print(f"simulated vLLM engine: {engine}\ncachewitness sidecar : {base}\n", flush=True)
            async with aiohttp.ClientSession() as http:
                session = Session(http, base)
                await session.wait_ready()
                await _script(session)
                lines = await _session_records(http, base)
            # Every scene's sidecar: the summary covers the whole session.
            lines += await _ram_cache_scene(Path(tmp))
            lines += await _mindnano_scene(Path(tmp))
        records = [orjson.loads(line) for line in lines if line.strip()]
        cases: list[CaseSummary] = summarize(records)
        print("\nevidence summary (from GET /cache/evidence of the three sidecars):")
        print(summary_table(cases))
        counts: dict[str, int] = {}
        for record in records:
            counts[record["event_type"]] = counts.get(record["event_type"], 0) + 1
        print("\nrecords written: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


def run_demo() -> int:
    """Blocking entry point of `cachewitness demo`."""
    return asyncio.run(_demo())
