"""Paths engines could read differently are refused before routing (issue 27, H1 and M2).

H1: cpp-httplib (llama-server) decodes `%u0073` as `s`; the sidecar's Python decoding did not,
so `/%u0073lots` reached llama-server's `/slots` with no admin check. M2: decoding until
nothing changed cost quadratic time. Now a path is decoded twice at most, and one that still
holds `%`, or holds `%u`, bytes that are not UTF-8 or control characters, gets 400
`invalid_request_target`. The property test spells every engine's control routes in every
way that engine's own decoder accepts (tests/support/path_spellings.py) and checks that none reaches it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from yarl import URL

from proxy.engines import llamacpp, mindnano, sglang, vllm
from proxy.engines.routes import RouteRule
from tests.support.capture import Capture, capturing
from tests.support.client import CLIENT_TIMEOUT
from tests.support.path_spellings import CPP_HTTPLIB, DECODERS, STARLETTE, decode, spellings
from tests.support.sidecar import serve_sidecar
from tests.support.sim import fast, sim

TOKEN = "admin-t0ken-for-path-tests"
# All of 127/8 is on lo (Linux): a client bound here is loopback, but not a trusted peer.
MESH_PEER = "127.0.0.6"


@dataclass
class Stack:
    """A simulator behind a capturing hop behind a sidecar, and a client (from `source`)."""

    url: str
    capture: Capture
    http: aiohttp.ClientSession

    async def call(self, method: str, target: str, **kw: Any) -> tuple[int, dict[str, Any] | None]:
        """One request with the target sent exactly as written; status and JSON body (None if not JSON)."""
        async with self.http.request(method, URL(self.url + target, encoded=True), **kw) as resp:
            body = await resp.json(content_type=None) if resp.content_type == "application/json" else None
            return resp.status, body

    def reached(self, target: str, method: str | None = None) -> bool:
        """Whether the engine saw a request for exactly this raw target (by this method, if named).

        The method matters: the sidecar's own engine detection sends `GET /props`, which is
        not a forwarded `POST /props`.
        """
        return any(seen.raw_path == target and method in (None, seen.method) for seen in self.capture.seen)


@asynccontextmanager
async def stack(
    dialect: str, tmp_path: Path, source: str = "127.0.0.1", **overrides: Any
) -> AsyncIterator[Stack]:
    """A sidecar (engine named) before a captured simulator; the client connects from `source`."""
    options: dict[str, Any] = {"slot_save_path": str(tmp_path / "slots")} if dialect == "llamacpp" else {}
    async with (
        sim(fast(dialect, **options)) as engine,
        capturing(engine.url) as capture,
        # Discovery off, as in test_engine_routes.py: the sidecar's own GET /kv_event_sources is no
        # client's request reaching the engine (CI once took it for a forwarded one).
        serve_sidecar(
            capture.url, tmp_path, **{"engine": dialect, "kv_events_discovery": "off", **overrides}
        ) as sidecar,
        aiohttp.ClientSession(
            timeout=CLIENT_TIMEOUT, connector=aiohttp.TCPConnector(local_addr=(source, 0))
        ) as http,
    ):
        yield Stack(sidecar.url, capture, http)


# -- H1: the llama.cpp control routes in %u spellings -------------------------------------------

U_SPELLINGS = [
    ("GET", "/%u0073lots"),
    ("GET", "/%U0073lots"),
    ("GET", "/%u0073LOTS"),
    ("GET", "/slot%u0073"),
    ("GET", "/slo%uD800ts"),  # cpp-httplib drops a surrogate escape: /slots
    ("POST", "/%u0073lots/0?action=erase"),
    ("POST", "/%u0073lots/0?action=save"),
    ("POST", "/%u0073lots/0?action=restore"),
    ("POST", "/slots/%u0030?action=erase"),
    ("POST", "/%u0070rops"),
    ("POST", "/%u0050rops"),
    ("POST", "/lora-adapter%u0073"),
    ("POST", "/lora-adapter%U0073"),
    ("POST", "/model%u0073/load"),
    ("POST", "/models/%u006Coad"),
    ("POST", "/models/unl%u006fad"),
    ("DELETE", "/model%u0073"),
    ("GET", "/cor%u0073-proxy?url=http://example.invalid/"),
    ("GET", "/%25u0073lots"),  # %u0073 after one pass
]


@pytest.mark.parametrize(("admin", "source"), [("token", "127.0.0.1"), ("no token", MESH_PEER)])
async def test_llamacpp_control_routes_in_u_spellings_are_refused(
    tmp_path: Path, admin: str, source: str
) -> None:
    overrides = {"admin_token": TOKEN} if admin == "token" else {}
    async with stack("llamacpp", tmp_path, source, **overrides) as s:
        for method, target in U_SPELLINGS:
            status, body = await s.call(method, target)
            assert status == 400, (method, target, status, body)
            assert body is not None and body["error"]["code"] == "invalid_request_target", body
            assert body["error"]["type"] == "invalid_request_error"
            assert not s.reached(target, method), target
        assert not [seen for seen in s.capture.seen if "%u" in seen.raw_path.lower()]


# -- Issue 45: prefix rules match before dot segments fold ----------------------------------------

DOT_TARGETS = ["/dumper/.", "/dumper/..", "/DUMPER/./x", "/dumper/%2E", "/hicache/.", "/dumper/x/.."]


async def test_a_prefix_rule_holds_for_a_path_whose_dot_segments_fold_out_of_it(tmp_path: Path) -> None:
    """`POST /dumper/.` folds to `/dumper`, outside the `/dumper/` prefix; an engine that does not
    fold dot segments routes it under the prefix: 401 without the token, never forwarded."""
    async with stack("sglang", tmp_path, admin_token=TOKEN) as s:
        for target in DOT_TARGETS:
            status, body = await s.call("POST", target, json={})
            assert status == 401, (target, status, body)
            assert not s.reached(target, "POST"), target
        status, _ = await s.call("POST", "/v1/./chat/completions", json={"model": "m", "messages": []})
        assert status != 401  # dot segments elsewhere are still plain traffic


# -- M2: two decoding passes, then 400 -------------------------------------------------------------


async def test_a_deeply_encoded_path_is_refused_not_decoded(tmp_path: Path) -> None:
    # 8 KB (aiohttp takes 8,190-byte request lines): decoded 4,081 times before, 2 bytes shorter each time.
    deep = "/%" + "25" * 4080 + "41"
    async with stack("vllm", tmp_path) as s:
        status, body = await s.call("GET", deep)
        assert status == 400 and body is not None, (status, body)
        assert body["error"]["code"] == "invalid_request_target"
        assert not s.reached(deep)
        # Three encodings deep: refused; two: decoded and judged (a control route needs the token).
        status, _ = await s.call("POST", "/%252572eset_prefix_cache")
        assert status == 400
        status, _ = await s.call("POST", "/%2572eset_prefix_cache")
        assert status == 200  # loopback without a token is admin: the intercepted reset ran
        status, _ = await s.call("GET", "/v1/%256dodels")
        assert status == 404 and s.reached("/v1/%256dodels")  # forwarded: the engine decodes once


async def test_refused_paths_are_counted_by_reason(tmp_path: Path) -> None:
    async with stack("llamacpp", tmp_path, admin_token=TOKEN) as s:
        for _ in range(3):
            assert (await s.call("GET", "/%u0073lots"))[0] == 400
        assert (await s.call("GET", "/slots"))[0] == 401
        async with s.http.get(s.url + "/metrics") as resp:
            text = await resp.text()
    assert 'cachewitness_route_refusals_total{reason="invalid_request_target"} 3.0' in text
    assert 'cachewitness_route_refusals_total{reason="missing_admin_token"} 1.0' in text


# -- the property: no spelling an engine's decoder accepts reaches its control routes -------------

ROUTES: dict[str, tuple[RouteRule, ...]] = {
    "vllm": (*vllm.CONTROL_ROUTES, vllm.NATIVE_RESET.rule),
    "sglang": (*sglang.CONTROL_ROUTES, sglang.NATIVE_RESET.rule),
    "llamacpp": (*llamacpp.CONTROL_ROUTES, llamacpp.SLOT_ERASE),
    "mindnano": (*mindnano.CONTROL_ROUTES, mindnano.NATIVE_RESET.rule),
}


def _targets(dialect: str) -> list[tuple[str, str, str]]:
    """(method, path, query) for each control route: its own path and, for a prefix, one below it."""
    targets: list[tuple[str, str, str]] = []
    for rule in ROUTES[dialect]:
        paths = [rule.path] if not rule.prefix else []
        if rule.prefix:
            paths.append(rule.path + ("x" if rule.path.endswith(("/", "_")) else "/0"))
            if not rule.path.endswith(("/", "_")):
                paths.append(rule.path)
        for method in sorted(rule.methods) or ["GET", "POST"]:
            for path in paths:
                queries = ["", "?action=erase", "?action=save", "?action=restore"]
                for query in queries if path.startswith("/slots/") else [""]:
                    targets.append((method, path, query))
    return targets


def test_the_spellings_decode_to_their_route() -> None:
    """The generator's own check: each decoder reads its spellings as the route (and Python agrees)."""
    from urllib.parse import unquote

    assert decode(CPP_HTTPLIB, "/%u0073lo%uD800t%73") == "/slots"
    assert decode(CPP_HTTPLIB, "/%U0073lots") == "/%U0073lots"  # uppercase U is not an escape there
    assert decode(STARLETTE, "/%u0073lots") == unquote("/%u0073lots") == "/%u0073lots"
    assert decode(STARLETTE, "/%2Fslots%2f0") == unquote("/%2Fslots%2f0")


# Each example is one request over a real socket: a quarter of the profile's examples per stack
# (dialect x admin mode), 75 each in `dev`, 2,500 in `ci`.
_EXAMPLES = max(50, settings().max_examples // 4)
GUARDS = {
    "token": ({"admin_token": TOKEN}, "127.0.0.1", (400, 401)),
    "untrusted peer": ({}, MESH_PEER, (400, 403)),  # no token: only trusted_peers are admin
}


@dataclass(frozen=True)
class Guarded:
    """A sidecar for one dialect, guarded one way, and the statuses a stranger may get."""

    dialect: str
    stack: Stack
    refused: tuple[int, ...]


@pytest.fixture(
    params=[(dialect, guard) for dialect in sorted(ROUTES) for guard in GUARDS],
    ids=lambda param: "-".join(param),
)
async def guarded(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Guarded]:
    """Each dialect's sidecar, with an admin token or with none; a client that is not admin."""
    dialect, guard = request.param
    overrides, source, refused = GUARDS[guard]
    async with stack(dialect, tmp_path, source, **overrides) as s:
        yield Guarded(dialect, s, refused)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=_EXAMPLES)
@given(data=st.data())
async def test_no_spelling_the_engine_decodes_to_a_control_route_is_forwarded(
    guarded: Guarded, data: st.DataObject
) -> None:
    method, path, query = data.draw(st.sampled_from(_targets(guarded.dialect)), label="route")
    decoder = data.draw(st.sampled_from(DECODERS[guarded.dialect]), label="decoder")
    raw = data.draw(spellings(decoder, path), label="spelling")
    assert decode(decoder, raw) == path
    status, body = await guarded.stack.call(method, raw + query)
    assert status in guarded.refused, (method, raw + query, status, body)
    assert not guarded.stack.reached(raw + query, method), (method, raw + query)
