"""The isolated runs of docs/benchmarks.md with the real tools, against the sidecar before real vLLM (CPU).

aiperf with `-H "X-Cachewitness-Isolation: request"`, `vllm bench serve` after `cachewitness reset
--isolation request` and with the header in its `--header`, and the reference client's reset URL
with `isolation=request` followed by its tagged requests. Each tool line runs twice in its case (the
same seed: unsalted, the second run's prompts would be cached). Each case: every request is
isolated and cold in its observation, and the case's `infer.cache_isolation` record (written at
`POST /cache/cases/{case_id}/close`) counts them all cold, with the verdict `cold`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.real.conftest import Pair, _require
from tests.real.sidecar_client import REQUEST_TIMEOUT, complete, long_prompt, new_case, tags
from tests.real.test_real_bench_tools import (
    REQUESTS,
    ToolRun,
    aiperf_argv,
    aiperf_bin,
    cachewitness_reset_argv,
    of_kind,
    run_tool,
    session_records,
    tool_env,
    vllm_bench_serve_argv,
)
from tests.support.reference_client import reset_cache

HEADER = "X-Cachewitness-Isolation"
CONCURRENCY = 2  # more than one request in flight: isolation must hold at concurrency, not only in turn


def isolated_aiperf_argv(url: str, tokenizer: Path, session: str, case: str, artifacts: Path) -> list[str]:
    """The isolated aiperf line of docs/benchmarks.md: the header on every request, no reset."""
    argv = aiperf_argv(url, tokenizer, session, case, artifacts)
    for flag in ("--reset-kv-cache", "--reset-kv-cache-path", "/cache/reset"):
        argv.remove(flag)
    argv[argv.index("--concurrency") + 1] = str(CONCURRENCY)
    at = argv.index("--request-count")
    return [*argv[:at], "-H", f"{HEADER}: request", *argv[at:]]


@pytest.fixture(scope="module")
def aiperf() -> Path:
    _require(aiperf_bin(), "aiperf")
    return aiperf_bin()


def with_concurrency(argv: list[str]) -> list[str]:
    argv = list(argv)
    argv[argv.index("--max-concurrency") + 1] = str(CONCURRENCY)
    return argv


async def run_twice(argv: list[str]) -> list[ToolRun]:
    """The same line twice in one case: the same seed, the same prompts, so that the second run's
    prompts are in the engine's cache unless each request was salted (its random prompts alone
    share no block)."""
    runs = [await run_tool(argv, tool_env()) for _ in range(2)]
    for run in runs:
        assert run.code == 0, run.output[-3000:]
    return runs


async def close_case(url: str, case: str) -> dict[str, Any]:
    """`POST /cache/cases/{case}/close`: the case's isolation tally ends and is written."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/cache/cases/{case}/close", timeout=REQUEST_TIMEOUT) as resp,
    ):
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


async def assert_every_request_cold(url: str, session: str, case: str, requests: int) -> dict[str, Any]:
    """Every observation of the case isolated and cold; its `infer.cache_isolation` record says `cold`."""
    closed = await close_case(url, case)
    records = await session_records(url, session, observations=requests)
    observed = [r for r in of_kind(records, "cache_observation") if r["case_id"] == case]
    assert len(observed) >= requests
    marks = [r["isolation"] for r in observed]
    assert all(m is not None and (m["mode"], m["result"]) == ("request", "cold") for m in marks), marks
    assert {m["field"] for m in marks} == {"cache_salt"}
    assert [r["cached_tokens"] for r in observed] == [0] * len(observed)
    (record,) = [r for r in of_kind(records, "cache_isolation") if r["case_id"] == case]
    assert record["session_id"] == session
    tally = (record["requests"], record["cold"], record["contradicted"], record["unobservable"])
    assert tally == (len(observed), len(observed), 0, 0), record
    assert record["verdict"] == "cold", record
    (answered,) = closed["isolation"]  # the close answers the record (the evidence adds its chain)
    assert answered.items() <= record.items(), (answered, record)
    return record


# -- aiperf: -H "X-Cachewitness-Isolation: request" ---------------------------------------------


async def test_aiperf_with_the_isolation_header_runs_every_request_cold(
    aiperf: Path, vllm: Pair, tiny_hf: Path, tmp_path: Path
) -> None:
    session, case = new_case()
    argv = isolated_aiperf_argv(vllm.url, tiny_hf, session, case, tmp_path / "artifacts")
    await run_twice(argv)
    await assert_every_request_cold(vllm.url, session, case, 2 * REQUESTS)


# -- vllm bench serve: the case isolated by its reset, or the header in --header ----------------


async def test_vllm_bench_serve_after_an_isolating_reset_runs_every_request_cold(
    vllm: Pair, tiny_hf: Path
) -> None:
    session, case = new_case()
    reset = await run_tool([*cachewitness_reset_argv(vllm.url, session, case), "--isolation", "request"])
    assert reset.code == 0, reset.output
    argv = with_concurrency(vllm_bench_serve_argv(vllm.url, tiny_hf, session, case))
    for run in await run_twice(argv):
        assert f"Successful requests:                     {REQUESTS}" in run.output
    record = await assert_every_request_cold(vllm.url, session, case, 2 * REQUESTS)
    # The reset opened the case: the engine's own counters over it agree (nothing beyond the canary).
    assert record["counters"]["result"] == "cold", record


async def test_vllm_bench_serve_with_the_isolation_header_runs_every_request_cold(
    vllm: Pair, tiny_hf: Path
) -> None:
    session, case = new_case()
    argv = with_concurrency(vllm_bench_serve_argv(vllm.url, tiny_hf, session, case))
    argv.append(f"{HEADER}=request")  # after X-Case-Id=…: the same --header (nargs="*")
    await run_twice(argv)
    await assert_every_request_cold(vllm.url, session, case, 2 * REQUESTS)


# -- the reference client: isolation in its reset URL -------------------------------------------


async def test_reference_client_reset_url_with_isolation_runs_every_request_cold(vllm: Pair) -> None:
    session, case = new_case()
    url = f"{vllm.url}/cache/reset?session_id={session}&case_id={case}&isolation=request"
    reset = await asyncio.to_thread(reset_cache, url, timeout_s=120)
    assert reset.answer == "acknowledged", reset
    body = {"model": "tiny", "prompt": long_prompt(), "max_tokens": 4, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        # The same prompt each time: without isolation the second and third would be served cached.
        answers = [await complete(s, vllm.url, body, tags(session, case)) for _ in range(3)]
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, 0, 0]
    record = await assert_every_request_cold(vllm.url, session, case, 3)
    assert record["counters"]["result"] == "cold", record
