"""llama-server's control routes in `%u` spellings, through the sidecar (issue 27, H1).

cpp-httplib, llama-server's HTTP library, decodes `%u0073` as `s` and drops `%uD800`..`%uDFFF`:
`GET /%u0073lots` is llama-server's `/slots`. The sidecar refuses every path with a `%u`
escape (400 `invalid_request_target`), and a spelling without one still needs the admin
token (401): never the engine's 200.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from yarl import URL

from proxy.engines.llamacpp import CONTROL_ROUTES
from tests.real import engines
from tests.real.conftest import Pair
from tests.real.engines import ManagedProcess
from tests.support.client import CLIENT_TIMEOUT

TOKEN = "real-llama-admin-token-for-path-tests"
SIDECAR_CODES = {"invalid_request_target", "missing_admin_token"}


def _u(char: str, upper_u: bool = False, upper_hex: bool = False) -> str:
    digits = f"{ord(char):04x}"
    return ("%U" if upper_u else "%u") + (digits.upper() if upper_hex else digits)


def _spellings(path: str) -> list[str]:
    """`path` with `%u`, `%U` and mixed escapes: first letter, every letter, a surrogate between."""
    head, rest = path[1], path[2:]
    every = "".join(
        _u(c, upper_hex=k % 2 == 1) if k % 3 else f"%{ord(c):02X}" for k, c in enumerate(path[1:])
    )
    return [
        "/" + _u(head) + rest,
        "/" + _u(head, upper_u=True) + rest,
        "/" + _u(head, upper_hex=True) + rest,
        "/" + every,
        "/" + head + "%uD800" + rest,  # cpp-httplib: nothing, so the path itself
        "/" + head + "%UDBFF" + rest,
        "/" + f"%{ord(head):02x}" + rest,  # no %u: decoded, then judged (a control route: 401)
    ]


def _targets() -> list[tuple[str, str]]:
    """(method, target) for every llama.cpp control route the sidecar lists, in every spelling."""
    targets: list[tuple[str, str]] = []
    for rule in CONTROL_ROUTES:
        path = rule.path + "/0" if rule.path == "/slots" else rule.path
        methods = sorted(rule.methods) or ["GET", "POST"]
        queries = ["?action=erase", "?action=save", "?action=restore"] if path == "/slots/0" else [""]
        if rule.path == "/cors-proxy":
            queries = ["?url=http://127.0.0.1:9/"]
        for spelled in _spellings(path) + (_spellings(rule.path) if path != rule.path else []):
            for method in methods:
                targets.extend((method, spelled + query) for query in queries)
    return targets


@pytest.fixture(scope="module")
def guarded_llama(llama: Pair) -> Iterator[ManagedProcess]:
    """A second sidecar before the shared llama-server, this one with an admin token."""
    workdir = Path(tempfile.mkdtemp(prefix="cw-real-paths-", dir=engines.logs_dir()))
    token_file = workdir / "token"
    token_file.write_text(TOKEN)
    sidecar = engines.start_sidecar(
        llama.engine_url, workdir / "ev.jsonl", ["--admin-token-file", str(token_file)]
    )
    yield sidecar
    engines.stop(sidecar)


async def _call(http: aiohttp.ClientSession, base: str, method: str, target: str) -> tuple[int, object]:
    async with http.request(method, URL(base + target, encoded=True), json={}) as resp:
        body = await resp.json(content_type=None) if "json" in resp.content_type else await resp.text()
        return resp.status, body


async def test_u_spellings_reach_llama_servers_control_handlers_directly(llama: Pair) -> None:
    """What the refusal guards against, on this llama-server build: `%u` is decoded by the engine."""
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
        status, body = await _call(http, llama.engine_url, "GET", "/%u0073lots")
        assert status == 200 and isinstance(body, list) and body and "id" in body[0], (status, body)
        status, body = await _call(http, llama.engine_url, "GET", "/slo%uD800ts")
        assert status == 200 and isinstance(body, list), (status, body)


async def test_no_u_spelling_of_a_control_route_passes_the_sidecar(guarded_llama: ManagedProcess) -> None:
    targets = _targets()
    assert len(targets) > 60
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
        for method, target in targets:
            status, body = await _call(http, guarded_llama.base_url, method, target)
            assert status in (400, 401), (method, target, status, body)
            assert isinstance(body, dict) and body["error"]["code"] in SIDECAR_CODES, (method, target, body)
            if "%u" in target.lower():
                assert status == 400, (method, target)
