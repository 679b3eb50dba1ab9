"""A reset's case token and `bind` (issue 27, M6): other clients' requests cannot forge its verdict.

The simulator runs behind a capturing hop (tests/support/capture.py), so a test sees every header that
reached the engine; the sidecar is the production one, served by serve.py's runner.
"""

from __future__ import annotations

import asyncio
import logging
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
from tests.support.sidecar import serve_sidecar
from tests.support.sim import Sim, chat, fast, sim, slow, words

CHAT = "/v1/chat/completions"
CASE = "X-Cachewitness-Case"


@dataclass(frozen=True)
class Rig:
    """A sidecar in front of a capturing hop in front of vLLM's simulator."""

    url: str
    hop: Capture
    http: aiohttp.ClientSession
    engine: Sim

    async def reset(self, **body: Any) -> dict[str, Any]:
        """POST /cache/reset (no canary: the traffic verdict is what is under test)."""
        async with self.http.post(self.url + "/cache/reset", json={"verify": "none", **body}) as response:
            assert response.status == 200, await response.text()
            answer: dict[str, Any] = await response.json()
            return answer

    async def infer(
        self, request_id: str, prompt: str, token: str | None = None, max_tokens: int = 4
    ) -> None:
        """One chat (a prompt of its own: 0 cached tokens after a reset), with the case token if given."""
        headers = {"X-Request-Id": request_id, **({CASE: token} if token is not None else {})}
        body = chat(words(40, prompt), max_tokens)
        async with self.http.post(self.url + CHAT, json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
            await response.read()

    async def state(self) -> dict[str, Any]:
        """GET /cache/state."""
        async with self.http.get(self.url + "/cache/state") as response:
            state: dict[str, Any] = await response.json()
            return state

    async def records(self, event_type: str) -> list[dict[str, Any]]:
        """The sidecar's records of one type, oldest first."""
        async with self.http.get(self.url + "/cache/evidence", params={"event_type": event_type}) as response:
            assert response.status == 200, await response.text()
            return [orjson.loads(line) for line in (await response.read()).splitlines() if line]


@asynccontextmanager
async def rig(tmp_path: Path, config: SimConfig | None = None, **overrides: Any) -> AsyncIterator[Rig]:
    """vLLM's simulator (fast unless `config`), a capturing hop, a sidecar with `overrides`, a client."""
    async with (
        sim(config or fast("vllm")) as engine,
        capturing(engine.url) as hop,
        serve_sidecar(hop.url, tmp_path, **overrides) as sidecar,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        yield Rig(sidecar.url, hop, http, engine)


async def test_with_bind_a_foreign_request_first_makes_the_verdict_inconclusive(tmp_path: Path) -> None:
    """The forgery of the security test: another client's request goes first, under ids it chooses."""
    async with rig(tmp_path) as r:
        stale = (await r.reset())["case_token"]
        answer = await r.reset(bind=True, session_id="run1", case_id="c1")
        token = answer["case_token"]
        assert answer["bind"] is True and isinstance(token, str) and token != stale
        # An earlier reset's token is no token of this one: the request is foreign.
        await r.infer("forged", "foreign", token=stale)
        assert (await r.state())["verdict"] == "pending"  # a foreign request never decides
        await r.infer("own", "benchmark", token=token)
        state = await r.state()
        observed = {o["request_id"]: o for o in await r.records("infer.cache_observation")}
        (verification,) = await r.records("infer.cache_verification")
    # The benchmark's own request saw 0 cached tokens, but the foreign one reached the engine first.
    assert observed["own"]["cached_tokens"] == 0
    assert (state["verdict"], state["verdict_request_id"], state["bind"]) == ("inconclusive", "own", True)
    assert (verification["verdict"], verification["bind"]) == ("inconclusive", True)
    # Both were counted and numbered; the records say which carried the token.
    assert state["since_reset"]["requests"] == 2
    assert [
        (observed[i]["ordinal_since_reset"], observed[i]["case_token_carried"]) for i in ("forged", "own")
    ] == [
        (1, False),
        (2, True),
    ]


async def test_with_bind_a_foreign_request_before_the_first_byte_makes_it_inconclusive(
    tmp_path: Path,
) -> None:
    """A foreign request that reached the engine after the benchmark's, but before its first byte,
    may have been run first (filling or evicting the cache): never `consistent`."""
    async with rig(tmp_path, slow("vllm")) as r:
        token = (await r.reset(bind=True))["case_token"]
        # Not a stream: the first byte is the whole answer, 40 tokens at 100 tokens/s.
        own = asyncio.create_task(r.infer("own", "benchmark", token=token, max_tokens=40))
        await r.engine.wait_stats(lambda stats: stats["running"] >= 1)
        await r.infer("other", "foreign")
        await asyncio.wait_for(own, timeout=10)
        state = await r.state()
        observed = {o["request_id"]: o for o in await r.records("infer.cache_observation")}
    assert observed["own"]["ordinal_since_reset"] == 1 and observed["own"]["cached_tokens"] == 0
    assert (state["verdict"], state["verdict_request_id"]) == ("inconclusive", "own")


async def test_with_bind_a_foreign_request_past_the_observation_budget_still_counts_as_first(
    tmp_path: Path,
) -> None:
    """A body too large to observe streams through unnumbered, yet it reached the engine first."""
    async with rig(tmp_path, max_buffered_bytes=4096) as r:
        token = (await r.reset(bind=True))["case_token"]
        large = chat(words(40, "foreign") + " " + "x" * 8192)
        async with r.http.post(r.url + CHAT, json=large, headers={"X-Request-Id": "large"}) as response:
            assert response.status == 200, await response.text()
            await response.read()
        await r.infer("own", "benchmark", token=token)
        state = await r.state()
        observed = [o["request_id"] for o in await r.records("infer.cache_observation")]
    assert observed == ["own"]  # the large one has no record: it was never observed
    assert (state["verdict"], state["verdict_request_id"]) == ("inconclusive", "own")


async def test_with_bind_the_token_carrying_requests_decide(tmp_path: Path) -> None:
    """The reset's own first request decides; foreign requests after it are counted, nothing more."""
    async with rig(tmp_path) as r:
        token = (await r.reset(bind=True))["case_token"]
        await r.infer("own", "benchmark", token=token)
        await r.infer("other", "foreign")
        state = await r.state()
    assert (state["verdict"], state["verdict_request_id"]) == ("consistent", "own")
    assert state["since_reset"]["requests"] == 2


async def test_without_bind_the_first_request_decides_as_before(tmp_path: Path) -> None:
    """bind defaults to false: clients that know nothing of tokens keep today's verdict."""
    async with rig(tmp_path) as r:
        answer = await r.reset()
        assert answer["bind"] is False and isinstance(answer["case_token"], str)
        await r.infer("first", "anyone")
        await r.infer("own", "benchmark", token=answer["case_token"])
        state = await r.state()
        observed = {
            o["request_id"]: o["case_token_carried"] for o in await r.records("infer.cache_observation")
        }
    assert (state["verdict"], state["verdict_request_id"], state["bind"]) == ("consistent", "first", False)
    assert observed == {"first": False, "own": True}


async def test_the_case_token_reaches_neither_the_engine_nor_the_evidence_nor_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The header is the sidecar's own: stripped before the engine, never written anywhere."""
    caplog.set_level(logging.DEBUG)
    async with rig(tmp_path) as r:
        answer = await r.reset(bind=True)
        token = answer["case_token"]
        await r.infer("own", "benchmark", token=token)
        (stream,) = [s for s in r.hop.seen if s.method == "POST" and s.raw_path == CHAT]
        assert (await r.state())["verdict"] == "consistent"
    assert "x-request-id" in {name.lower() for name, _ in stream.headers}  # the hop sees client headers
    assert CASE.lower() not in {name.lower() for name, _ in stream.headers}
    assert all(token not in value for _, value in stream.headers)
    # The reset's own record (in the answer and on disk) has no token either: only the answer does.
    assert token not in orjson.dumps(answer["cache_state"]).decode()
    files = sorted((tmp_path / "evidence").iterdir())
    written = b"".join(path.read_bytes() for path in files)
    assert b'"case_token_carried":true' in written and token.encode() not in written
    assert all(
        token not in record.getMessage() and token not in str(record.__dict__) for record in caplog.records
    )


async def test_bind_must_be_a_boolean_and_is_refused_with_scope_cluster(tmp_path: Path) -> None:
    """Bad `bind` input is a 400 naming it; a cluster reset cannot bind (each pod has its own token)."""
    async with rig(tmp_path) as r:
        for query in ("?bind=maybe", "?bind=true&scope=cluster"):
            async with r.http.post(r.url + "/cache/reset" + query) as response:
                assert response.status == 400
                assert (await response.json())["error"]["param"] == "bind"
        async with r.http.post(r.url + "/cache/reset?bind=yes&verify=none") as response:
            assert response.status == 200 and (await response.json())["bind"] is True


async def test_a_token_that_differs_only_in_its_tail_or_length_is_foreign(tmp_path: Path) -> None:
    """The whole token is compared: a forger who learnt its start (a log line cut short, a prefix
    leaked by a side channel) still holds no token of this case."""
    async with rig(tmp_path) as r:
        token = (await r.reset(bind=True, session_id="run1", case_id="c1"))["case_token"]
        last = "A" if token[-1] != "A" else "B"
        forgeries = {"tail": token[:-1] + last, "short": token[:-1], "long": token + "A", "start": token[:8]}
        for name, forged in forgeries.items():
            await r.infer(name, name, token=forged)
        await r.infer("own", "benchmark", token=token)
        carried = {
            o["request_id"]: o["case_token_carried"] for o in await r.records("infer.cache_observation")
        }
    assert carried == {"tail": False, "short": False, "long": False, "start": False, "own": True}
