"""Admin auth on `/cache/*` (docs/routes.md): bearer token, loopback-only without one, `--admin-open`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.admin.auth import is_trusted
from proxy.config import Settings
from tests.support.client import CLIENT_TIMEOUT
from tests.support.sidecar import stack
from tests.support.sim import fast

TOKEN = "t0k3n-for-tests"


@asynccontextmanager
async def sidecar(tmp_path: Path, host: str = "127.0.0.1", **overrides: Any) -> AsyncIterator[str]:
    """A vLLM simulator and a sidecar bound on `host`; yields the sidecar's URL."""
    async with stack(fast("vllm"), tmp_path, host=host, **overrides) as s:
        yield s.url


async def post_reset(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
        http.post(f"{url}/cache/reset", headers=headers or {}) as resp,
    ):
        return resp.status, await resp.json()


async def test_missing_token_is_401(tmp_path: Path) -> None:
    async with sidecar(tmp_path, admin_token=TOKEN) as url:
        status, body = await post_reset(url)
    assert status == 401 and body["error"]["code"] == "missing_admin_token"


async def test_wrong_token_is_401(tmp_path: Path) -> None:
    async with sidecar(tmp_path, admin_token=TOKEN) as url:
        status, body = await post_reset(url, {"Authorization": "Bearer nope"})
    assert status == 401 and body["error"]["code"] == "invalid_admin_token"


async def test_a_strict_prefix_of_the_token_is_401(tmp_path: Path) -> None:
    # A comparison that stops at the shorter string would let this through.
    async with sidecar(tmp_path, admin_token=TOKEN) as url:
        status, body = await post_reset(url, {"Authorization": f"Bearer {TOKEN[:5]}"})
    assert status == 401 and body["error"]["code"] == "invalid_admin_token"


async def test_the_token_with_a_suffix_is_401(tmp_path: Path) -> None:
    async with sidecar(tmp_path, admin_token=TOKEN) as url:
        status, body = await post_reset(url, {"Authorization": f"Bearer {TOKEN}x"})
    assert status == 401 and body["error"]["code"] == "invalid_admin_token"


async def test_right_token_is_let_in(tmp_path: Path) -> None:
    async with sidecar(tmp_path, admin_token=TOKEN) as url:
        status, body = await post_reset(url, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and body["answer"] == "acknowledged"


async def test_every_cache_route_needs_the_token(tmp_path: Path) -> None:
    async with (
        sidecar(tmp_path, admin_token=TOKEN) as url,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        for path in ("/cache/state", "/cache/evidence"):
            async with http.get(url + path) as resp:
                assert resp.status == 401, path


async def test_forwarded_traffic_is_not_subject_to_admin_auth(tmp_path: Path) -> None:
    async with (
        sidecar(tmp_path, admin_token=TOKEN) as url,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        async with http.get(f"{url}/v1/models", headers={"Authorization": "Bearer client-key"}) as resp:
            assert resp.status == 200


async def test_loopback_client_needs_no_token_when_none_is_set(tmp_path: Path) -> None:
    async with sidecar(tmp_path) as url:
        status, _ = await post_reset(url)
    assert status == 200


async def test_non_loopback_client_without_token_is_403_with_how_to(tmp_path: Path, remote_host: str) -> None:
    async with sidecar(tmp_path, host=remote_host) as url:
        status, body = await post_reset(url)
    assert status == 403
    assert "--admin-token-file" in body["error"]["message"] and "--admin-open" in body["error"]["message"]
    assert "CACHEWITNESS_ADMIN_TOKEN" in body["error"]["message"]


@pytest.mark.parametrize(
    "header", ["X-Forwarded-For", "X-Real-IP", "Forwarded", "X-Forwarded-Host", "X-Client-IP"]
)
async def test_non_loopback_client_claiming_loopback_in_a_header_is_still_403(
    tmp_path: Path, remote_host: str, header: str
) -> None:
    # Forwarded headers are the client's to write: only the TCP peer's address decides.
    value = "for=127.0.0.1" if header == "Forwarded" else "127.0.0.1"
    async with sidecar(tmp_path, host=remote_host) as url:
        status, body = await post_reset(url, {header: value})
    assert status == 403 and body["error"]["code"] == "admin_loopback_only"


async def test_admin_open_lets_non_loopback_clients_in(tmp_path: Path, remote_host: str) -> None:
    async with sidecar(tmp_path, host=remote_host, admin_open=True) as url:
        status, body = await post_reset(url)
    assert status == 200 and body["answer"] == "acknowledged"


async def test_token_lets_non_loopback_clients_in(tmp_path: Path, remote_host: str) -> None:
    async with sidecar(tmp_path, host=remote_host, admin_token=TOKEN) as url:
        status, _ = await post_reset(url, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200


DEFAULT_PEERS = Settings().trusted_peers


@pytest.mark.parametrize(
    ("host", "trusted"),
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("127.0.0.2", False),  # 127/8 is loopback, but only 127.0.0.1 is trusted by default
        ("127.0.0.6", False),  # where Istio's sidecar proxy connects from
        ("192.0.2.7", False),
        ("::ffff:192.0.2.7", False),
        ("fd00::2", False),
        ("", False),
        (None, False),
        ("not-an-ip", False),
    ],
)
def test_default_trusted_peers(host: str | None, trusted: bool) -> None:
    assert is_trusted(host, DEFAULT_PEERS) is trusted


def test_trusted_peers_take_cidrs() -> None:
    peers = ("10.0.0.0/8", "127.0.0.6")
    assert is_trusted("10.1.2.3", peers) and is_trusted("::ffff:10.1.2.3", peers)
    assert is_trusted("127.0.0.6", peers) and not is_trusted("127.0.0.1", peers)
    assert not is_trusted("127.0.0.1", ())


# -- trusted_peers through the production runner, from a source address in 127/8 ------------------


async def post_reset_from(source: str, url: str) -> tuple[int, dict[str, Any]]:
    """POST /cache/reset from a connection whose source address is `source` (all of 127/8 is on lo)."""
    connector = aiohttp.TCPConnector(local_addr=(source, 0))
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT, connector=connector) as http,
        http.post(f"{url}/cache/reset") as resp,
    ):
        return resp.status, await resp.json()


async def test_a_mesh_proxy_address_in_127_8_is_not_local_by_default(tmp_path: Path) -> None:
    # Istio's sidecar connects to the app from 127.0.0.6: loopback, but not this machine's own client.
    async with sidecar(tmp_path) as url:
        status, body = await post_reset_from("127.0.0.6", url)
        assert status == 403 and body["error"]["code"] == "admin_loopback_only", body
        assert "trusted_peers" in body["error"]["message"]
        status, _ = await post_reset_from("127.0.0.1", url)
        assert status == 200


async def test_trusted_peers_lets_a_listed_address_in(tmp_path: Path) -> None:
    async with sidecar(tmp_path, trusted_peers=("127.0.0.1", "127.0.0.0/29")) as url:
        status, body = await post_reset_from("127.0.0.6", url)
        assert status == 200 and body["answer"] == "acknowledged", body
        status, _ = await post_reset_from("127.0.0.9", url)
        assert status == 403


async def test_trusted_peers_do_not_matter_once_a_token_is_set(tmp_path: Path) -> None:
    async with sidecar(tmp_path, admin_token=TOKEN, trusted_peers=("127.0.0.0/8",)) as url:
        status, body = await post_reset_from("127.0.0.6", url)
    assert status == 401 and body["error"]["code"] == "missing_admin_token"
