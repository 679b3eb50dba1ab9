"""The benchmark tools' own reset calls against the sidecar, in each tool's own terms (docs/benchmarks.md).

Rows of the compatibility matrix whose tool cannot run here, or whose reset logic is a few lines
restated in tests/: the reference client's `reset_cache()` (tests/reference_client.py), SGLang's
`bench_serving --flush-cache` (SGLang has no CPU install from PyPI) and the built-in reset of
`vllm bench sweep` (it posts to the port of the server it starts: restated here, the real sweep
with `--after-bench-cmd` is in tests/real/test_real_bench_tools.py). Each: the call reaches the
sidecar, the record carries what the tool tags it with, the reset is verified, and a
contradicted reset fails the tool at once where the tool reads the answer at all.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from proxy.sim import SimConfig
from tests.support.evidence_files import evidence_records
from tests.support.reference_client import ClientReset, cache_state_record, reset_cache
from tests.support.sidecar import running_request, stack
from tests.support.sim import fast, slow

TOKEN = "bench-tools-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _states(tmp_path: Path) -> list[dict[str, Any]]:
    """The sidecar's `infer.cache_state` records (read after it stopped)."""
    records = evidence_records(tmp_path / "evidence" / "cachewitness.jsonl")
    return [r for r in records if r["event_type"] == "infer.cache_state"]


def _differing(client: dict[str, Any], sidecar: dict[str, Any]) -> set[str]:
    """The client record's fields (reset.* one level down) whose value the sidecar's record does not share."""
    differ = {name for name in client if name != "reset" and client[name] != sidecar.get(name)}
    differ |= {
        f"reset.{name}" for name in client["reset"] if client["reset"][name] != sidecar["reset"].get(name)
    }
    return differ


async def _client_reset(url: str, **options: Any) -> ClientReset:
    """The reference client's blocking reset, off the loop that serves the sidecar."""
    return await asyncio.to_thread(reset_cache, url, timeout_s=60, **options)


# -- the reference client -------------------------------------------------------------------------


@pytest.mark.parametrize("verify", ["canary", "none"])
async def test_reference_client_acknowledged_record_differs_only_in_url_and_times(
    verify: str, tmp_path: Path
) -> None:
    async with stack(fast("vllm"), tmp_path, verify=verify) as s:
        reset = await _client_reset(f"{s.url}/cache/reset?session_id=ref-1&case_id=c1")
    client = cache_state_record(session_id="ref-1", case_id="c1", reset=reset)
    (sidecar,) = _states(tmp_path)
    assert reset.answer == "acknowledged" and sidecar["session_id"] == "ref-1"
    # The client records the URL it called (the sidecar's), the sidecar the engine's; each its own moments.
    expected = {"reset.url", "reset.at_ns", "reset.answered_at_ns"}
    if verify == "canary":
        expected |= {"verified", "reason"}  # the canary proved what the client alone cannot
        assert sidecar["verified"] == "verified"
    assert _differing(client, sidecar) == expected
    assert reset.at_ns <= sidecar["reset"]["at_ns"] <= sidecar["reset"]["answered_at_ns"]
    assert sidecar["reset"]["answered_at_ns"] <= (reset.answered_at_ns or 0)


async def test_reference_client_sees_a_refusal_as_the_sidecars_409(tmp_path: Path) -> None:
    async with stack(slow("vllm"), tmp_path, drain=False, retry_seconds=1) as s:
        async with running_request(s, max_tokens=2000):
            reset = await _client_reset(f"{s.url}/cache/reset?session_id=ref-2&case_id=c1", retry_s=0)
    client = cache_state_record(session_id="ref-2", case_id="c1", reset=reset)
    (sidecar,) = _states(tmp_path)
    assert (reset.status, reset.error, reset.answer) == (409, "HTTP 409", None)
    # The sidecar recorded the engine's answer: 200 with success false, on every retry.
    assert (sidecar["reset"]["status"], sidecar["reset"]["answer"]) == (200, "refused")
    attempts = sidecar["reset"]["attempts"]
    assert attempts >= 2 and sidecar["reset"]["error"] == f"refused: success false on {attempts} attempts"
    assert _differing(client, sidecar) == {
        "reason",
        "reset.url",
        "reset.at_ns",
        "reset.answered_at_ns",
        "reset.status",
        "reset.error",
        "reset.success",
        "reset.answer",
        "reset.attempts",
    }
    assert client["acknowledged"] is sidecar["acknowledged"] is False
    assert client["run_kind"] == sidecar["run_kind"] == "unspecified"


async def test_reference_client_sees_a_contradicted_reset_as_502_and_does_not_retry(tmp_path: Path) -> None:
    async with stack(fast("vllm", reset_leaves_warm=True), tmp_path) as s:
        reset = await _client_reset(f"{s.url}/cache/reset?session_id=ref-3&case_id=c1")
    client = cache_state_record(session_id="ref-3", case_id="c1", reset=reset)
    (sidecar,) = _states(tmp_path)
    assert (reset.status, reset.error, reset.attempts, reset.succeeded) == (502, "HTTP 502", 1, False)
    assert client["reason"] == "the cache reset failed (HTTP 502)"
    # The engine did acknowledge; the canary proved it false.
    assert (sidecar["reset"]["answer"], sidecar["acknowledged"], sidecar["verified"]) == (
        "acknowledged",
        True,
        "contradicted",
    )
    assert client["run_kind"] == sidecar["run_kind"] == "unspecified"
    assert "acknowledged" in _differing(client, sidecar)


# -- SGLang bench_serving --flush-cache -----------------------------------------------------------


def sglang_flush(base_url: str, api_key: str | None) -> None:
    """bench_serving's flush: `requests.post(base_url + "/flush_cache", headers=get_auth_headers())`.

    Its answer is not read at all (sglang/bench_serving.py, every release to 0.5.x): nothing the
    sidecar answers can stop the benchmark. Restated with urllib; an HTTP error is swallowed as
    `requests` would not raise it either.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(base_url + "/flush_cache", data=b"", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            exc.read()


async def _flush_status(url: str) -> int:
    """The status the sidecar gives bench_serving's flush (the tool itself never looks)."""
    request = urllib.request.Request(url + "/flush_cache", data=b"", headers=AUTH, method="POST")

    def call() -> int:
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            with exc:
                return int(exc.code)

    return await asyncio.to_thread(call)


def _uniform(config: SimConfig, tmp_path: Path, **overrides: Any) -> Any:
    """A sidecar with `native_resets = "uniform"` (and the admin token unless overridden)."""
    settings = {"admin_token": TOKEN, "engine": config.dialect, "native_resets": "uniform", **overrides}
    return stack(config, tmp_path, **settings)


async def test_sglang_bench_serving_flush_is_a_verified_uniform_reset(tmp_path: Path) -> None:
    async with _uniform(fast("sglang"), tmp_path) as s:
        await asyncio.to_thread(sglang_flush, s.url, TOKEN)
    (state,) = _states(tmp_path)
    assert (state["via"], state["verified"], state["acknowledged"]) == ("native", "verified", True)
    assert state["session_id"] is None  # bench_serving tags nothing: its records carry no session


async def test_sglang_bench_serving_flush_contradicted_is_502_which_the_tool_ignores(tmp_path: Path) -> None:
    async with _uniform(fast("sglang", reset_leaves_warm=True), tmp_path) as s:
        assert await _flush_status(s.url) == 502
        await asyncio.to_thread(sglang_flush, s.url, TOKEN)  # returns: the tool would go on
    assert [state["verified"] for state in _states(tmp_path)] == ["contradicted", "contradicted"]


# -- vllm bench sweep's built-in reset ------------------------------------------------------------

SWEEP_ENDPOINTS = ("/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache")


def sweep_reset_caches(base_url: str) -> None:
    """`vllm bench sweep`'s ServerProcess.reset_caches: each endpoint posted, `raise_for_status()`.

    It sends no token: the sidecar lets it in as a trusted loopback peer (no admin token set).

    Restated with urllib (vllm/benchmarks/sweep/server.py, 0.32): urllib raises HTTPError where
    requests' raise_for_status() raises, on any status of 400 or more.
    """
    for endpoint in SWEEP_ENDPOINTS:
        request = urllib.request.Request(base_url + endpoint, data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()


async def test_vllm_bench_sweep_reset_is_a_verified_uniform_reset(tmp_path: Path) -> None:
    async with _uniform(fast("vllm"), tmp_path, admin_token=None) as s:
        await asyncio.to_thread(sweep_reset_caches, s.url)
    (state,) = _states(tmp_path)
    assert (state["via"], state["verified"], state["reset"]["answer"]) == (
        "native",
        "verified",
        "acknowledged",
    )


async def test_vllm_bench_sweep_reset_fails_at_once_when_contradicted(tmp_path: Path) -> None:
    async with _uniform(fast("vllm", reset_leaves_warm=True), tmp_path, admin_token=None) as s:
        with pytest.raises(urllib.error.HTTPError) as failed:
            await asyncio.to_thread(sweep_reset_caches, s.url)
    failed.value.close()
    assert failed.value.code == 502 and failed.value.headers["X-Cachewitness-Answer"] == "contradicted"
    (state,) = _states(tmp_path)  # one reset: the sweep stopped at its first endpoint
    assert state["verified"] == "contradicted"


async def test_vllm_bench_sweep_reset_of_a_refusing_engine_is_409(tmp_path: Path) -> None:
    async with _uniform(slow("vllm"), tmp_path, admin_token=None, drain=False, retry_seconds=1) as s:
        async with running_request(s, max_tokens=2000):
            with pytest.raises(urllib.error.HTTPError) as failed:
                await asyncio.to_thread(sweep_reset_caches, s.url)
    failed.value.close()
    assert failed.value.code == 409 and failed.value.headers["X-Cachewitness-Answer"] == "refused"
