"""A newcomer's first hour (issue 32): the mistakes a new user makes get one line that says the fix.

A URL without its scheme, a misspelt config key or environment variable, a bad value in the
environment, a reset or a request while the engine is down: each answer names what is wrong and
what to do, once.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest

from proxy.cli.http import DEFAULT_URL
from proxy.config import ConfigError, Settings
from proxy.config.load import load_settings
from tests.support.cli import REPO, cli
from tests.support.sidecar import closed_port_url, free_port, serve_sidecar
from tests.support.sim import WAIT_S

# -- the client commands ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["reset", "evidence", "report"])
async def test_a_url_without_its_scheme_is_bad_input_with_the_fix(command: str, tmp_path: Path) -> None:
    extra = ["--session-id", "s", "-o", str(tmp_path / "r.html")] if command == "report" else []
    run = await cli(command, "--url", "127.0.0.1:18000", *extra)
    assert run.code == 2
    assert run.stderr.strip() == (
        f"cachewitness {command}: --url 127.0.0.1:18000 is not an http(s) URL; did you mean http://127.0.0.1:18000?"
    )


async def test_the_env_url_is_checked_too() -> None:
    run = await cli("reset", env={"CACHEWITNESS_URL": "localhost:8000"})
    assert run.code == 2 and "CACHEWITNESS_URL localhost:8000 is not an http(s) URL" in run.stderr


def test_the_defaults_are_the_documented_ports() -> None:
    settings = Settings()
    assert (settings.listen, settings.upstream, DEFAULT_URL) == (
        "0.0.0.0:8000",
        "http://127.0.0.1:8200",
        "http://127.0.0.1:8000",
    )


# -- configuration mistakes -------------------------------------------------------------------------


def test_an_unknown_config_key_suggests_the_close_one(tmp_path: Path) -> None:
    config = tmp_path / "cw.toml"
    config.write_text("retry_second = 5\n")
    with pytest.raises(ConfigError) as error:
        load_settings({}, env={}, config_file=str(config))
    assert (
        str(error.value) == f"config: unknown key 'retry_second' in {config}; did you mean 'retry_seconds'?"
    )


def test_an_unknown_config_key_far_from_any_points_at_the_list(tmp_path: Path) -> None:
    config = tmp_path / "cw.toml"
    config.write_text("zzzz = 5\n")
    with pytest.raises(ConfigError) as error:
        load_settings({}, env={}, config_file=str(config))
    message = str(error.value)
    assert message.endswith("; every key: cachewitness serve --help, or docs/cli.md")
    assert "retry_seconds" not in message  # not the list of every key


def test_a_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError) as error:
        load_settings({}, env={"CACHEWITNESS_RETRY_SECONDS": "soon"})
    assert "(from env CACHEWITNESS_RETRY_SECONDS)" in str(error.value)


async def _stderr_line(process: asyncio.subprocess.Process, wanted: str) -> str:
    """The first stderr line holding `wanted` (bounded wait)."""
    assert process.stderr is not None
    async with asyncio.timeout(WAIT_S * 3):
        while True:  # bounded by the timeout; a closed stderr ends it with a failure
            line = (await process.stderr.readline()).decode()
            assert line, f"stderr closed before a line with {wanted!r}"
            if wanted in line:
                return line


async def test_an_unknown_cachewitness_variable_is_warned_about_at_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEWITNESS_")}
    env.update({"CACHEWITNESS_RETRY_SECOND": "5", "CACHEWITNESS_URL": "http://127.0.0.1:1"})
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve",
        "--listen", f"127.0.0.1:{free_port()}", "--upstream", closed_port_url(),
        "--evidence", str(tmp_path / "ev.jsonl"),
        cwd=REPO, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        line = await _stderr_line(process, "CACHEWITNESS_RETRY_SECOND")
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), timeout=60)
    record = orjson.loads(line)
    assert record["level"] == "warning" and record["event"] == "config_unknown_env"
    assert record["msg"] == (
        "CACHEWITNESS_RETRY_SECOND is not a cachewitness setting and is ignored; "
        "did you mean 'CACHEWITNESS_RETRY_SECONDS'?"
    )


def test_client_and_build_variables_are_not_warned_about() -> None:
    from proxy.config.load import unknown_env

    assert (
        unknown_env({"CACHEWITNESS_URL": "x", "CACHEWITNESS_CONFIG": "y", "CACHEWITNESS_REAL_CACHE": "z"})
        == []
    )


def test_admin_token_create_writes_a_private_token_once(tmp_path: Path) -> None:
    path = tmp_path / "cw-token"
    first = load_settings({"admin_token_file": str(path), "admin_token_create": "true"}, env={})
    assert first.admin_token and len(first.admin_token) >= 32
    assert path.stat().st_mode & 0o777 == 0o600
    again = load_settings({"admin_token_file": str(path), "admin_token_create": "true"}, env={})
    assert again.admin_token == first.admin_token  # an existing file is kept


def test_admin_token_create_without_a_file_says_so() -> None:
    with pytest.raises(ConfigError, match="admin_token_create needs admin_token_file"):
        load_settings({"admin_token_create": "true"}, env={})


# -- the engine down --------------------------------------------------------------------------------


async def test_a_reset_while_the_engine_is_down_says_unreachable_once(tmp_path: Path) -> None:
    upstream = closed_port_url()
    address = upstream.removeprefix("http://")
    async with serve_sidecar(upstream, tmp_path, engine="auto") as sidecar:
        run = await cli("reset", "--url", sidecar.url)
        async with aiohttp.ClientSession() as http, http.post(f"{sidecar.url}/cache/reset") as response:
            answer = await response.json()
    assert run.code == 6, run.stderr
    assert answer["detail"] == f"unreachable: cannot connect to the engine at {address}: connection refused"
    assert (
        answer["hint"]
        == "start the engine, or fix --upstream; --engine names its kind when it cannot be detected"
    )
    line = run.stdout.strip()
    assert line.startswith("unreachable: engine unknown")
    assert (
        line.count("connection refused") == 1
        and "no reset to verify" not in line
        and "unverified" not in line
    )


@pytest.mark.parametrize(
    ("upstream", "reason"),
    [
        ("refused", "connection refused"),
        ("http://no-such-host.invalid:8200", "no such host ("),
    ],
)
async def test_a_502_names_the_os_error_and_the_address(upstream: str, reason: str, tmp_path: Path) -> None:
    url = closed_port_url() if upstream == "refused" else upstream
    address = url.removeprefix("http://")
    async with (
        serve_sidecar(url, tmp_path, engine="vllm") as sidecar,
        aiohttp.ClientSession() as http,
        http.post(f"{sidecar.url}/v1/chat/completions", json={"model": "m", "messages": []}) as response,
    ):
        body = await response.json()
    assert response.status == 502
    message = body["error"]["message"]
    assert message.startswith(f"cannot connect to the engine at {address}: {reason}"), message
