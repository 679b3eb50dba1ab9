"""The route policy (issue 14): engine control routes are admin routes, every spelling of them included;
the sidecar's own admin routes are exactly its method+path pairs (issue 16 item 10); the admin token
never reaches the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from proxy.admin.policy import normalise_path
from tests.support.capture import Capture, capturing
from tests.support.client import CLIENT_TIMEOUT
from tests.support.sidecar import free_port, serve_sidecar
from tests.support.sim import chat, fast, sim

TOKEN = "admin-t0ken-for-route-tests"
ENGINE_KEY = "engine-key-for-route-tests"


@dataclass
class Stack:
    """A simulator behind a capturing hop behind a sidecar; `url` is the sidecar's."""

    url: str
    capture: Capture
    http: aiohttp.ClientSession

    def reached(self, fragment: str) -> list[str]:
        """Requests the engine saw whose raw path contains `fragment` (case-insensitive)."""
        return [p for p in self.capture.paths() if fragment.lower() in p.lower()]

    async def call(
        self, method: str, path: str, headers: dict[str, str] | None = None, **kw: Any
    ) -> tuple[int, bytes]:
        """One raw request to the sidecar; the path is sent exactly as written."""
        url = URL(self.url + path, encoded=True)
        async with self.http.request(method, url, headers=headers or {}, **kw) as resp:
            return resp.status, await resp.read()


@asynccontextmanager
async def stack(
    dialect: str, tmp_path: Path, host: str = "127.0.0.1", **overrides: Any
) -> AsyncIterator[Stack]:
    """A sidecar on `host` (engine named, so no detection race) in front of a captured simulator."""
    options: dict[str, Any] = {"slot_save_path": str(tmp_path / "slots")} if dialect == "llamacpp" else {}
    async with (
        sim(fast(dialect, **options)) as engine,
        capturing(engine.url) as capture,
        # Discovery off: the sidecar's own GET /kv_event_sources is no client's request reaching the engine.
        serve_sidecar(
            capture.url, tmp_path, host=host, **{"engine": dialect, "kv_events_discovery": "off", **overrides}
        ) as sidecar,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        yield Stack(sidecar.url, capture, http)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# -- normalisation --------------------------------------------------------------------------

SPELLINGS = [
    "/reset_prefix_cache",
    "//reset_prefix_cache",
    "/./reset_prefix_cache",
    "/reset_prefix_cache/",
    "/reset_prefix_cache//",
    "/RESET_PREFIX_CACHE",
    "/Reset_Prefix_Cache",
    "/%72eset_prefix_cache",
    "/%2572eset_prefix_cache",
    "/%25%37%32eset_prefix_cache",
    "/v1/../reset_prefix_cache",
    "/v1/%2E%2E/reset_prefix_cache",
    "%2Freset_prefix_cache",
    "/%2Freset_prefix_cache",
    "/%252Freset_prefix_cache",
    "\\reset_prefix_cache",
]


@pytest.mark.parametrize("raw", SPELLINGS)
def test_every_spelling_normalises_to_the_route(raw: str) -> None:
    assert normalise_path(raw) == "/reset_prefix_cache"


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("/slots%2F0", "/slots/0"),
        ("/slots%252F0", "/slots/0"),
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("/", "/"),
        ("/a?b=/reset_prefix_cache", "/a"),
        ("/a?b=%u0073", "/a"),  # the query is not the path
        ("/v1/models/a%20b", "/v1/models/a b"),
    ],
)
def test_normalise_path(raw: str, canonical: str) -> None:
    assert normalise_path(raw) == canonical


@pytest.mark.parametrize(
    "raw",
    [
        "/%",  # a lone %, left as it is by every decoder
        "/%zz",
        "/%2525",  # `%` after two passes
        "/%25252573lots",  # three encodings deep
        "/%u0073lots",  # cpp-httplib: /slots
        "/%U0073lots",
        "/%25u0073lots",  # %u0073 after one pass
        "/slo%uD800ts",  # cpp-httplib drops the surrogate: /slots
        "/slots%FF",  # not UTF-8: Python decoders replace it, cpp-httplib keeps it
        "/props%00",  # NUL
        "/v1/chat%0D%0Acompletions",
    ],
)
def test_a_path_engines_could_read_differently_is_not_normalised(raw: str) -> None:
    assert normalise_path(raw) is None


# -- strangers ------------------------------------------------------------------------------

CONTROL = {
    "vllm": [
        ("POST", "/reset_prefix_cache?reset_running_requests=true"),
        ("POST", "/collective_rpc"),
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("GET", "/server_info"),
        ("POST", "/update_weights"),
        ("GET", "/kv_event_sources"),
    ],
    "sglang": [
        ("POST", "/flush_cache"),
        ("GET", "/flush_cache"),
        ("POST", "/update_weights_from_disk"),
        ("POST", "/release_memory_occupation"),
        ("POST", "/abort_request"),
    ],
    "llamacpp": [
        ("GET", "/slots"),
        ("POST", "/slots/0?action=erase"),
        ("POST", "/slots/0?action=save"),
        ("POST", "/props"),
        ("POST", "/lora-adapters"),
    ],
    "mindnano": [("POST", "/v1/cache/clear"), ("POST", "/v1/cancel")],
}
MARKERS = {
    "vllm": [
        "reset_prefix",
        "collective",
        "sleep",
        "wake",
        "server_info",
        "update_weights",
        "kv_event_sources",
    ],
    "sglang": ["flush", "update_weights", "release_memory", "abort"],
    "llamacpp": ["slots", "POST /props", "lora"],
    "mindnano": ["cache/clear", "cancel"],
}
INFERENCE = {
    "vllm": "/v1/chat/completions",
    "sglang": "/v1/chat/completions",
    "llamacpp": "/v1/chat/completions",
    "mindnano": "/v1/chat/completions",
}


def _reached_any(s: Stack, dialect: str) -> list[str]:
    return [p for marker in MARKERS[dialect] for p in s.reached(marker)]


@pytest.mark.parametrize("dialect", sorted(CONTROL))
async def test_stranger_without_token_is_403_and_the_engine_never_sees_it(
    dialect: str, tmp_path: Path, remote_host: str
) -> None:
    async with stack(dialect, tmp_path, host=remote_host) as s:
        for method, path in CONTROL[dialect]:
            status, body = await s.call(method, path)
            assert status == 403, (method, path, body)
        assert _reached_any(s, dialect) == []
        status, _ = await s.call("POST", INFERENCE[dialect], json=chat("hello there"))
        assert status == 200


@pytest.mark.parametrize("dialect", sorted(CONTROL))
async def test_stranger_without_the_token_is_401_when_one_is_set(
    dialect: str, tmp_path: Path, remote_host: str
) -> None:
    async with stack(dialect, tmp_path, host=remote_host, admin_token=TOKEN) as s:
        for method, path in CONTROL[dialect]:
            for headers in ({}, bearer("not-the-token")):
                status, _ = await s.call(method, path, headers)
                assert status == 401, (method, path, headers)
        assert _reached_any(s, dialect) == []
        status, _ = await s.call("POST", INFERENCE[dialect], json=chat("hello there"))
        assert status == 200


@pytest.mark.parametrize("raw", [raw for raw in SPELLINGS if raw.startswith("/")])
async def test_no_spelling_of_a_control_route_slips_past(raw: str, tmp_path: Path, remote_host: str) -> None:
    async with stack("vllm", tmp_path, host=remote_host, admin_token=TOKEN) as s:
        for method in ("POST", "GET"):
            status, _ = await s.call(method, raw)
            assert status == 401, (method, raw)
        status, _ = await s.call("POST", raw.replace("reset_prefix_cache", "collective_rpc"))
        assert status == 401
        assert s.reached("reset_prefix") == [] and s.reached("collective") == []


async def test_slot_spellings_with_encoded_slash_need_the_token(tmp_path: Path, remote_host: str) -> None:
    async with stack("llamacpp", tmp_path, host=remote_host, admin_token=TOKEN) as s:
        for raw in (
            "/slots%2F0?action=erase",
            "/SLOTS/0?action=erase",
            "/slots%252F1?action=erase",
            "//slots",
        ):
            status, _ = await s.call("POST" if "?" in raw else "GET", raw)
            assert status == 401, raw
        assert s.reached("slots") == []


async def test_the_token_lets_a_stranger_reach_a_control_route(tmp_path: Path, remote_host: str) -> None:
    async with stack("llamacpp", tmp_path, host=remote_host, admin_token=TOKEN) as s:
        status, body = await s.call("GET", "/slots", bearer(TOKEN))
        assert status == 200, body
        assert s.reached("GET /slots")


async def test_loopback_needs_no_token_when_none_is_set(tmp_path: Path) -> None:
    async with stack("llamacpp", tmp_path) as s:
        status, _ = await s.call("GET", "/slots")
        assert status == 200


async def test_engine_routes_open_is_the_old_unsafe_behaviour(tmp_path: Path, remote_host: str) -> None:
    async with stack("llamacpp", tmp_path, host=remote_host, engine_routes="open") as s:
        status, _ = await s.call("GET", "/slots")
        assert status == 200 and s.reached("GET /slots")


async def test_extra_admin_paths_need_the_token(tmp_path: Path, remote_host: str) -> None:
    async with stack(
        "vllm", tmp_path, host=remote_host, admin_token=TOKEN, extra_admin_paths=("/tokenize", "/debug/*")
    ) as s:
        for raw in ("/tokenize", "/TOKENIZE/", "/debug/anything", "/debug/"):
            status, _ = await s.call("POST", raw)
            assert status == 401, raw
        assert s.reached("tokenize") == [] and s.reached("debug") == []
        status, _ = await s.call("POST", "/detokenize")
        assert status != 401


async def test_unknown_engine_kind_guards_every_known_engines_routes(
    tmp_path: Path, remote_host: str
) -> None:
    async with stack("vllm", tmp_path, host=remote_host, admin_token=TOKEN, engine="generic") as s:
        for method, path in [("POST", "/collective_rpc"), ("POST", "/flush_cache"), ("GET", "/slots")]:
            status, _ = await s.call(method, path)
            assert status == 401, path


async def test_an_engine_not_yet_detected_is_detected_before_its_reset_route_is_judged(
    tmp_path: Path,
) -> None:
    # The upstream is down when the sidecar starts (kind unknown) and comes up later; the
    # health watcher does not probe again in the test's time, so the route policy must detect.
    port = free_port()
    async with (
        serve_sidecar(
            f"http://127.0.0.1:{port}", tmp_path, admin_token=TOKEN, health_interval=3600.0
        ) as side,
        sim(fast("vllm")) as engine,
        capturing(engine.url, port=port) as capture,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        async with http.post(f"{side.url}/collective_rpc") as resp:
            assert resp.status == 401
        async with http.post(f"{side.url}/reset_prefix_cache", headers=bearer(TOKEN)) as resp:
            assert (resp.status, await resp.json()) == (200, {"success": True})
            assert resp.headers["X-Cachewitness-Answer"] == "acknowledged"  # intercepted, not forwarded
        assert not [p for p in capture.paths() if "collective" in p]


# -- the sidecar's own admin routes are exact method+path pairs (issue 16 item 10) -----------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/cache/reset"),
        ("POST", "/cache/reset/"),
        ("POST", "/cache/state"),
        ("PUT", "/cache/evidence"),
    ],
)
async def test_other_cache_paths_are_forwarded_without_admin_auth(
    method: str, path: str, tmp_path: Path
) -> None:
    async with stack("vllm", tmp_path, admin_token=TOKEN) as s:
        status, _ = await s.call(method, path)
        assert status == 404  # the engine's answer: the sidecar did not ask for a token
        status, _ = await s.call(method, path, bearer(TOKEN))
        assert status == 404
        seen = [x for x in s.capture.seen if x.raw_path == path]
        assert len(seen) == 2
        assert all(TOKEN not in value for x in seen for _, value in x.headers)


async def test_the_sidecars_own_routes_still_need_the_token(tmp_path: Path) -> None:
    async with stack("vllm", tmp_path, admin_token=TOKEN) as s:
        for method, path in [("POST", "/cache/reset"), ("GET", "/cache/state"), ("HEAD", "/cache/state")]:
            status, _ = await s.call(method, path)
            assert status == 401, (method, path)


# -- the admin token never reaches the engine --------------------------------------------------


async def test_the_admin_token_never_reaches_the_engine(tmp_path: Path) -> None:
    async with stack("llamacpp", tmp_path, admin_token=TOKEN, upstream_api_key=ENGINE_KEY) as s:
        auth = bearer(TOKEN)

        async def reached(
            method: str, path: str, headers: dict[str, str], **kw: Any
        ) -> dict[str, tuple[str, ...]]:
            """What one call to the sidecar made the engine see: path -> its Authorization values."""
            before = len(s.capture.seen)
            await s.call(method, path, headers, **kw)
            # The health watcher's probes (no credentials) may land in between: not this call's.
            return {x.raw_path: x.authorization for x in s.capture.seen[before:] if x.raw_path != "/health"}

        # A client's own request: the admin token is removed, nothing is put in its place.
        sent = await reached("POST", "/v1/chat/completions", auth, json=chat("hello there"))
        assert sent["/v1/chat/completions"] == ()
        # A client's own key passes as it is.
        assert (await reached("GET", "/v1/models", bearer("client-key")))["/v1/models"] == (
            "Bearer client-key",
        )
        # Control calls, and the sidecar's own calls (reset, canary), carry the engine's key.
        assert (await reached("GET", "/slots", auth))["/slots"] == (f"Bearer {ENGINE_KEY}",)
        erase = await reached("POST", "/slots/0?action=erase", auth)
        assert erase["/slots/0?action=erase"] == (f"Bearer {ENGINE_KEY}",)
        resets = await reached("POST", "/cache/reset", auth)
        assert resets and set(resets.values()) == {(f"Bearer {ENGINE_KEY}",)}, resets
        # Not the sidecar's route: forwarded, without the token.
        assert (await reached("GET", "/cache/reset", auth))["/cache/reset"] == ()
    assert len(s.capture.seen) >= 6
    for seen in s.capture.seen:
        assert all(TOKEN not in value for _, value in seen.headers), seen


def test_a_remembered_decision_is_for_the_engine_it_was_made_for() -> None:
    """The policy remembers plain traffic's decisions; a re-detected engine gets its own."""
    from multidict import MultiDict

    from proxy.admin.policy import RouteClass, RoutePolicy
    from proxy.config import Settings
    from proxy.engine_state import make_dialect
    from proxy.vocabulary import EngineKind

    settings = Settings()
    policy = RoutePolicy(settings)
    llamacpp, vllm = make_dialect(EngineKind.LLAMACPP, settings), make_dialect(EngineKind.VLLM, settings)
    for _ in range(2):  # the second time from memory
        assert (
            policy.classify("POST", "/reset_prefix_cache", MultiDict(), llamacpp).route
            is RouteClass.FORWARDED
        )
    assert policy.classify("POST", "/reset_prefix_cache", MultiDict(), vllm).route is RouteClass.NATIVE_RESET
    # A slot call decided without erase does not decide the next one, which erases.
    assert (
        policy.classify("POST", "/slots/0", MultiDict(action="restore"), llamacpp).route is RouteClass.CONTROL
    )
    assert (
        policy.classify("POST", "/slots/0", MultiDict(action="erase"), llamacpp).route
        is RouteClass.SLOT_ERASE
    )
