"""Cold by construction, through `python -m proxy serve` in front of the simulator (docs/reset.md).

An isolated request reaches the engine with a fresh salt or its cache bypass, its observation
says what its answer proved, its case's tally ends as an `infer.cache_isolation` record; a
request that cannot be isolated is answered by the sidecar and never reaches the engine.
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
import pytest

from proxy.sim import SimConfig
from tests.support.capture import Capture, capturing
from tests.support.client import CLIENT_TIMEOUT
from tests.support.metrics import scrape
from tests.support.process import start_sidecar, stop
from tests.support.sim import WAIT_S, Sim, chat, fast, sim, words

PROMPT = words(40)
ISOLATED = {"X-Cachewitness-Isolation": "request"}


@dataclass(frozen=True)
class Served:
    """The simulator, the capturing hop in front of it, and the sidecar in front of both."""

    engine: Sim
    capture: Capture
    url: str
    http: aiohttp.ClientSession

    async def ask(self, headers: dict[str, str] | None = None, **fields: Any) -> tuple[int, dict[str, Any]]:
        """One chat through the sidecar: status and JSON answer."""
        body = fields.pop("raw", None)
        data = body if body is not None else orjson.dumps(chat(PROMPT, 2, **fields))
        async with self.http.post(
            f"{self.url}/v1/chat/completions",
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        ) as resp:
            return resp.status, await resp.json(content_type=None)

    async def cached(self, headers: dict[str, str] | None = None, **fields: Any) -> int:
        """Cached tokens of one successful chat."""
        status, data = await self.ask(headers, **fields)
        assert status == 200, data
        return int(data["usage"]["prompt_tokens_details"]["cached_tokens"])

    async def post(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        """POST to one of the sidecar's own routes."""
        async with self.http.post(self.url + path, json=body) as resp:
            return resp.status, await resp.json()

    async def records(self, event_type: str) -> list[dict[str, Any]]:
        """The sidecar's records of one type."""
        async with self.http.get(f"{self.url}/cache/evidence", params={"event_type": event_type}) as resp:
            assert resp.status == 200, await resp.text()
            return [orjson.loads(line) for line in (await resp.read()).splitlines() if line]

    async def state(self) -> dict[str, Any]:
        """GET /cache/state."""
        async with self.http.get(f"{self.url}/cache/state") as resp:
            state: dict[str, Any] = await resp.json()
            return state

    def sent(self) -> list[dict[str, Any]]:
        """The chat bodies that reached the engine, decoded."""
        return [orjson.loads(s.body) for s in self.capture.seen if s.raw_path == "/v1/chat/completions"]


@asynccontextmanager
async def served(config: SimConfig, tmp_path: Path, *flags: str) -> AsyncIterator[Served]:
    """A simulator behind a capturing hop behind `python -m proxy serve` with `flags`."""
    async with sim(config) as engine, capturing(engine.url) as capture:
        process, url = await start_sidecar(capture.url, tmp_path, "--engine", config.dialect, *flags)
        try:
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
                yield Served(engine, capture, url, http)
        finally:
            await stop(process)


async def test_the_header_isolates_a_request_and_never_reaches_the_engine(tmp_path: Path) -> None:
    async with served(fast("vllm"), tmp_path) as s:
        assert await s.cached() == 0
        assert await s.cached() > 0  # not isolated: the repeat hits
        assert await s.cached(ISOLATED) == 0
        assert await s.cached(ISOLATED) == 0
        salts = [body.get("cache_salt") for body in s.sent()]
        assert salts[:2] == [None, None]
        assert len({salts[2], salts[3]}) == 2 and all(len(str(salt)) == 22 for salt in salts[2:])
        for seen in s.capture.seen:
            assert "x-cachewitness-isolation" not in {name.lower() for name, _ in seen.headers}
        marks = [record["isolation"] for record in await s.records("infer.cache_observation")]
        isolated = {"mode": "request", "result": "cold", "field": "cache_salt"}
        assert marks == [None, None, isolated, isolated]


async def test_a_clients_own_cache_salt_is_kept_as_the_prefix(tmp_path: Path) -> None:
    async with served(fast("vllm"), tmp_path) as s:
        assert await s.cached(cache_salt="tenant-7") == 0
        assert await s.cached(ISOLATED, cache_salt="tenant-7") == 0
        salt = s.sent()[-1]["cache_salt"]
        assert salt.startswith("tenant-7") and len(salt) == len("tenant-7") + 22
        assert await s.cached(cache_salt="tenant-7") > 0  # the client's own salt still holds


async def test_config_isolation_makes_32_concurrent_requests_of_one_prompt_all_cold(tmp_path: Path) -> None:
    async with served(fast("vllm"), tmp_path, "--isolation", "request") as s:
        cached = await asyncio.gather(*(s.cached() for _ in range(32)))
        assert cached == [0] * 32
        metrics = await scrape(s.http, s.url)
        assert metrics.value("cachewitness_isolated_requests_total", result="cold") == 32
        assert metrics.value("cachewitness_isolated_requests_total", result="contradicted") == 0


async def test_without_isolation_the_same_run_shows_hits(tmp_path: Path) -> None:
    async with served(fast("vllm"), tmp_path) as s:
        cached = await asyncio.gather(*(s.cached() for _ in range(32)))
        assert sum(1 for n in cached if n > 0) > 0


async def test_a_reset_isolates_its_case_until_the_next_reset(tmp_path: Path) -> None:
    tags = {"X-Session-Id": "s1", "X-Case-Id": "c1"}
    async with served(fast("vllm"), tmp_path) as s:
        status, body = await s.post(
            "/cache/reset", {"session_id": "s1", "case_id": "c1", "isolation": "request"}
        )
        assert status == 200, body
        assert [await s.cached(tags) for _ in range(3)] == [0, 0, 0]
        assert await s.cached() == 0  # the reset emptied the cache; isolated requests left nothing
        assert await s.cached() > 0  # another case's request is not isolated
        state = await s.state()
        assert state["isolation"]["cases"] == [{"session_id": "s1", "case_id": "c1"}]
        [tally] = state["isolation"]["open"]
        assert (tally["requests"], tally["cold"], tally["verdict"]) == (3, 3, "cold")
        status, body = await s.post("/cache/reset", {"session_id": "s1", "case_id": "c1"})
        assert status == 200, body
        await s.cached(tags)
        assert await s.cached(tags) > 0  # the next reset ended the isolation
        [record] = await s.records("infer.cache_isolation")
        assert (record["session_id"], record["case_id"], record["closed_by"]) == ("s1", "c1", "reset")
        assert (record["requests"], record["cold"], record["contradicted"], record["unobservable"]) == (
            3,
            3,
            0,
            0,
        )
        assert record["verdict"] == "cold"
        # The engine's counters over the case: one request was not isolated, so they cannot tell.
        assert record["counters"]["other_requests"] == 2
        assert record["counters"]["result"] == "inconclusive"


async def test_the_isolate_route_isolates_a_case_without_a_reset(tmp_path: Path) -> None:
    async with served(fast("vllm"), tmp_path) as s:
        status, body = await s.post("/cache/cases/c9/isolate")
        assert (status, body["isolation"]) == (200, "request")
        assert [await s.cached({"X-Case-Id": "c9", "X-Session-Id": f"any-{i}"}) for i in range(2)] == [0, 0]
        status, body = await s.post("/cache/cases/c9/close")
        assert status == 200, body
        assert [r["requests"] for r in body["isolation"]] == [1, 1]  # one tally per session


async def served_by(s: Served) -> dict[str, int]:
    """How many requests each server took (requests_total by served_by)."""
    counts = {"front": 0, "aiohttp": 0}
    for (name, labels), value in (await scrape(s.http, s.url)).samples.items():
        if name == "cachewitness_requests_total":
            counts[dict(labels)["served_by"]] += int(value)
    return counts


@pytest.mark.parametrize(
    ("dialect", "version", "server"),
    [
        ("openai", None, "front"),
        ("sglang", "0.5.2", "front"),
        ("trtllm", None, "front"),
        ("dynamo", None, "aiohttp"),
    ],
)
async def test_an_engine_without_isolation_answers_501(
    tmp_path: Path, dialect: str, version: str | None, server: str
) -> None:
    config = fast(dialect, version=version) if version else fast(dialect)
    flags: tuple[str, ...] = ("--engine", "generic") if dialect == "openai" else ()
    flags += ("--no-front",) if server == "aiohttp" else ()
    async with served(config, tmp_path, *flags) as s:
        status, data = await s.ask(ISOLATED)
        assert status == 501, data
        assert data["error"]["code"] == "isolation_unsupported"
        assert "reset the cache" in data["error"]["hint"]
        assert s.sent() == []
        metrics = await scrape(s.http, s.url)
        assert metrics.value("cachewitness_isolated_requests_total", result="refused") == 1
        assert (await served_by(s))[server] == 1
        [record] = await s.records("infer.cache_observation")
        assert record["isolation"]["result"] == "refused"


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"[1, 2]", 400, "isolation_invalid_body"),
        (b'{"messages": [], "cache_salt": 7}', 400, "isolation_invalid_body"),
        (b"{}", 400, "invalid_isolation"),
    ],
)
async def test_a_body_that_cannot_be_isolated_is_refused_and_not_forwarded(
    tmp_path: Path, raw: bytes, status: int, code: str
) -> None:
    headers = {"X-Cachewitness-Isolation": "yes please"} if code == "invalid_isolation" else ISOLATED
    async with served(fast("vllm"), tmp_path) as s:
        got, data = await s.ask(headers, raw=raw)
        assert (got, data["error"]["code"]) == (status, code)
        assert s.sent() == []
        assert (await s.engine.stats())["requests_total"] == 0


async def test_a_body_too_large_to_observe_is_refused_413(tmp_path: Path) -> None:
    async with served(fast("vllm"), tmp_path, "--max-buffered-bytes", "2048") as s:
        status, data = await s.ask(ISOLATED, messages=[{"role": "user", "content": words(600)}])
        assert (status, data["error"]["code"]) == (413, "isolation_body_too_large")
        assert s.sent() == []


@pytest.mark.parametrize("dialect", ["llamacpp", "mindnano"])
async def test_cache_prompt_false_isolates_llamacpp_and_mindnano(tmp_path: Path, dialect: str) -> None:
    async with served(fast(dialect), tmp_path, "--isolation", "request") as s:
        assert [await s.cached() for _ in range(2)] == [0, 0]
        assert [body["cache_prompt"] for body in s.sent()] == [False, False]
        marks = [record["isolation"]["field"] for record in await s.records("infer.cache_observation")]
        assert marks == ["cache_prompt", "cache_prompt"]


async def test_an_engine_that_ignores_isolation_makes_the_case_contradicted(tmp_path: Path) -> None:
    tags = {"X-Session-Id": "s1", "X-Case-Id": "c1"}
    async with served(fast("vllm", ignore_isolation=True), tmp_path) as s:
        status, body = await s.post(
            "/cache/reset", {"session_id": "s1", "case_id": "c1", "isolation": "request"}
        )
        assert status == 200, body
        assert await s.cached(tags) == 0
        assert await s.cached(tags) > 0
        [tally] = (await s.state())["isolation"]["open"]
        assert (tally["cold"], tally["contradicted"], tally["verdict"]) == (1, 1, "contradicted")
        status, body = await s.post("/cache/cases/c1/close")
        assert status == 200, body
        [record] = body["isolation"]
        assert (record["verdict"], record["closed_by"]) == ("contradicted", "close")
        assert record["counters"]["result"] == "contradicted"  # the engine's own counters agree
        metrics = await scrape(s.http, s.url)
        assert metrics.value("cachewitness_isolated_requests_total", result="contradicted") == 1


async def test_an_idle_isolated_case_ends_as_a_record(tmp_path: Path) -> None:
    tags = {**ISOLATED, "X-Session-Id": "s2", "X-Case-Id": "idle-case"}
    async with served(fast("vllm"), tmp_path, "--case-idle-s", "0.3") as s:
        assert await s.cached(tags) == 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while not (records := await s.records("infer.cache_isolation")):
            assert loop.time() < deadline, await s.state()
            await asyncio.sleep(0.05)
        [record] = records
        assert (record["case_id"], record["closed_by"], record["requests"], record["verdict"]) == (
            "idle-case",
            "idle",
            1,
            "cold",
        )
        assert (await s.state())["isolation"]["open"] == []


async def test_an_isolated_case_open_at_shutdown_keeps_its_record(tmp_path: Path) -> None:
    async with sim(fast("vllm")) as engine:
        process, url = await start_sidecar(engine.url, tmp_path, "--engine", "vllm")
        try:
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
                tags = {**ISOLATED, "X-Session-Id": "s3", "X-Case-Id": "c3"}
                async with http.post(
                    f"{url}/v1/chat/completions", json=chat(PROMPT, 2), headers=tags
                ) as resp:
                    assert resp.status == 200
        finally:
            await stop(process)
    lines = [orjson.loads(line) for line in (tmp_path / "ev.jsonl").read_bytes().splitlines() if line]
    [record] = [r for r in lines if r["event_type"] == "infer.cache_isolation"]
    assert (record["case_id"], record["closed_by"], record["cold"]) == ("c3", "shutdown", 1)


@pytest.mark.parametrize("flags", [(), ("--no-front",)], ids=["front", "aiohttp"])
async def test_an_isolated_stream_keeps_its_injected_usage_on_both_servers(
    tmp_path: Path, flags: tuple[str, ...]
) -> None:
    async with served(fast("vllm"), tmp_path, *flags) as s:
        for _ in range(2):
            async with s.http.post(
                f"{s.url}/v1/chat/completions", json=chat(PROMPT, 2, stream=True), headers=ISOLATED
            ) as resp:
                assert resp.status == 200
                body = await resp.read()
            assert b"cache_salt" not in body and b'"usage"' not in body  # the injected usage taken out again
        sent = s.sent()
        assert all(
            b["stream_options"] == {"include_usage": True} and len(b["cache_salt"]) == 22 for b in sent
        )
        marks = [
            (r["usage_injected"], r["isolation"]["result"])
            for r in await s.records("infer.cache_observation")
        ]
        assert marks == [(True, "cold"), (True, "cold")]
        assert await served_by(s) == {"front": 0, "aiohttp": 0, "front" if not flags else "aiohttp": 2}


@pytest.mark.parametrize(
    ("path", "field"), [("/v1/chat/completions", "cache_salt"), ("/generate", "extra_key")]
)
async def test_sglang_is_isolated_by_its_own_field(tmp_path: Path, path: str, field: str) -> None:
    body = (
        chat(PROMPT, 2) if path != "/generate" else {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    )
    async with served(fast("sglang"), tmp_path) as s:
        for _ in range(2):
            async with s.http.post(f"{s.url}{path}", json=body, headers=ISOLATED) as resp:
                assert resp.status == 200, await resp.text()
        sent = [orjson.loads(seen.body) for seen in s.capture.seen if seen.raw_path == path]
        assert [len(b[field]) for b in sent] == [22, 22] and sent[0][field] != sent[1][field]
        marks = [r["isolation"] for r in await s.records("infer.cache_observation")]
        assert marks == [{"mode": "request", "result": "cold", "field": field}] * 2
