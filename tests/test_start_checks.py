"""A sidecar pointed at itself is refused at start, in one line, instead of hanging every request."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.serve import points_at_itself
from tests.support.sidecar import free_port


def serve(
    args: list[str], tmp_path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`cachewitness serve ARGS` with the environment's CACHEWITNESS_* settings removed."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CACHEWITNESS_")}
    return subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--evidence", str(tmp_path / "ev.jsonl"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **(env or {})},
    )


def assert_refused_as_itself(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "own listen address" in line and "Traceback" not in done.stderr
    return line


def test_upstream_equal_to_the_listen_address_exits_2_with_one_line(tmp_path: Path) -> None:
    port = free_port()
    done = serve(["--upstream", f"http://127.0.0.1:{port}", "--listen", f"127.0.0.1:{port}"], tmp_path)
    assert f"127.0.0.1:{port}" in assert_refused_as_itself(done)


def test_omitted_upstream_while_listening_on_its_default_port_exits_2(tmp_path: Path) -> None:
    # No upstream given: it defaults to http://127.0.0.1:8200, which the sidecar would own.
    line = assert_refused_as_itself(serve(["--listen", "0.0.0.0:8200"], tmp_path))
    assert "default upstream" in line and "--upstream" in line


def test_upstream_by_name_from_the_environment_is_caught_too(tmp_path: Path) -> None:
    port = free_port()
    done = serve(
        ["--listen", f"0.0.0.0:{port}"], tmp_path, env={"CACHEWITNESS_UPSTREAM": f"http://localhost:{port}"}
    )
    assert_refused_as_itself(done)


def own_address() -> str | None:
    """A non-loopback address of this machine, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


@pytest.mark.parametrize(
    ("upstream", "listen_host", "listen_port", "loops"),
    [
        ("http://127.0.0.1:9000", "0.0.0.0", 9000, True),
        ("http://localhost:9000", "127.0.0.1", 9000, True),
        ("http://0.0.0.0:9000", "127.0.0.1", 9000, True),
        ("https://127.0.0.1", "::", 443, True),  # the scheme's default port
        ("http://127.0.0.1:9000", "0.0.0.0", 9001, False),
        ("http://127.0.0.2:9000", "127.0.0.1", 9000, False),  # another loopback address
        ("http://192.0.2.1:9000", "0.0.0.0", 9000, False),  # not an address of this machine
        ("http://[::1]:9000", "0.0.0.0", 9000, False),  # 0.0.0.0 takes IPv4 only
        ("http://no-such-host.invalid:9000", "0.0.0.0", 9000, False),
        ("http://127.0.0.1:9000", "127.0.0.1", 0, False),  # an ephemeral port is never the upstream's
    ],
)
def test_points_at_itself(upstream: str, listen_host: str, listen_port: int, loops: bool) -> None:
    assert points_at_itself(upstream, listen_host, listen_port) is loops


def test_own_non_loopback_address_counts_under_a_wildcard_listen() -> None:
    address = own_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    assert points_at_itself(f"http://{address}:9000", "0.0.0.0", 9000)
    assert not points_at_itself(f"http://{address}:9000", "127.0.0.1", 9000)
