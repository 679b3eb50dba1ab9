"""The simulator's options and its blocking runner."""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys

import aiohttp
import pytest

from proxy.sim import SimConfig, add_sim_arguments, parse_listen, sim_config_from_args
from tests.support.client import CLIENT_TIMEOUT


def parse(*argv: str) -> argparse.Namespace:
    """Parse simulator options."""
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_match_the_spec() -> None:
    ns = parse()
    assert parse_listen(ns.listen) == ("127.0.0.1", 8000)
    assert sim_config_from_args(ns) == SimConfig()
    assert SimConfig().block_size == 16 and SimConfig().decode_rate == 50 and SimConfig().prefill_rate == 5000


def test_every_option_reaches_the_config() -> None:
    ns = parse(
        "--dialect",
        "llamacpp",
        "--listen",
        "0.0.0.0:9",
        "--decode-rate",
        "0",
        "--prefill-rate",
        "0",
        "--block-size",
        "32",
        "--cache-blocks",
        "10",
        "--max-concurrency",
        "3",
        "--legacy-empty-body",
        "--no-dev-mode",
        "--no-prompt-tokens-details",
        "--omit-zero-cached",
        "--admin-api-key",
        "k",
        "--slots",
        "4",
        "--slot-save-path",
        "/tmp",
        "--ram-cache",
        "--model",
        "m",
        "--version",
        "b1",
    )
    assert parse_listen(ns.listen) == ("0.0.0.0", 9)
    assert sim_config_from_args(ns) == SimConfig(
        dialect="llamacpp",
        decode_rate=0,
        prefill_rate=0,
        block_size=32,
        cache_blocks=10,
        max_concurrency=3,
        legacy_empty_body=True,
        dev_mode=False,
        prompt_tokens_details=False,
        omit_zero_cached=True,
        admin_api_key="k",
        slots=4,
        slot_save_path="/tmp",
        ram_cache=True,
        model="m",
        version="b1",
    )


def test_bad_listen_is_rejected() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_listen("nope")


def test_ipv6_listen_is_split() -> None:
    assert parse_listen("[::1]:8000") == ("::1", 8000)


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="dialect"):
        SimConfig(dialect="tgi")


def _free_port() -> int:
    """A free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_run_sim_serves_and_exits_0_on_sigterm() -> None:
    port = _free_port()
    code = f"from proxy.sim import SimConfig, run_sim; raise SystemExit(run_sim(SimConfig(dialect='sglang'), '127.0.0.1', {port}))"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stderr is not None
        line = await asyncio.wait_for(proc.stderr.readline(), 30)
        assert b"sglang engine on" in line
        async with (
            aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
            http.get(f"http://127.0.0.1:{port}/server_info") as resp,
        ):
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("argv", [["--listen", "nope"], ["--slots", "0"]])
def test_sim_command_with_a_bad_option_exits_2_with_one_line(argv: list[str]) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "proxy", "sim", *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
