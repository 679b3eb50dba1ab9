"""The admin token never reaches the engine, in any spelling (issue 27, L3).

The sidecar's bearer check reads `Authorization: Bearer <token>`; a client (or a tool) that
writes the token some other way — a tab after `Bearer`, a list, `Basic`, `x-api-key`, a
cookie — used to have it forwarded to the engine as it was. Every header that holds the
token is now dropped, whatever its name or scheme; the tests look at what a capturing hop
in front of the engine received.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import aiohttp
import pytest
from yarl import URL

from tests.support.capture import Capture, Seen, capturing
from tests.support.client import CLIENT_TIMEOUT
from tests.support.process import start_sidecar, stop
from tests.support.sidecar import serve_sidecar
from tests.support.sim import chat, fast, sim

TOKEN = "admin-t0ken-for-spelling-tests"
ENGINE_KEY = "engine-key-for-spelling-tests"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _escaped(text: str) -> str:
    """Every character percent-encoded."""
    return "".join(f"%{byte:02X}" for byte in text.encode())


SPELLINGS: dict[str, tuple[str, str]] = {
    "bearer and a tab": ("Authorization", f"Bearer\t{TOKEN}"),
    "bearer in a list": ("Authorization", f"Bearer {TOKEN}, Bearer someone-else"),
    "lowercase bearer": ("Authorization", f"bearer {TOKEN}"),
    "no scheme": ("Authorization", TOKEN),
    "basic, raw": ("Authorization", f"Basic {TOKEN}"),
    "basic, user:token": ("Authorization", "Basic " + _b64(f"admin:{TOKEN}")),
    "basic, token:": ("Authorization", "basic\t" + _b64(f"{TOKEN}:")),
    "x-api-key": ("x-api-key", TOKEN),
    "api-key": ("api-key", TOKEN),
    "proxy-authorization": ("Proxy-Authorization", f"Bearer {TOKEN}"),
    "cookie": ("Cookie", f"theme=dark; session={TOKEN}"),
    "inside another value": ("X-Anything", f"prefix-{TOKEN}-suffix"),
    "in a header's name": (f"X-{TOKEN}", "1"),
    # Issue 45: spellings a lenient decoder reads as the token.
    "basic, whitespace inside the base64": ("Authorization", "Basic " + " ".join(_b64(f"admin:{TOKEN}"))),
    "percent-encoded": ("Authorization", "Bearer " + _escaped(TOKEN)),
    "percent-encoded cookie": ("Cookie", f"session={_escaped(TOKEN)}"),
    "percent-encoded twice": ("X-Anything", _escaped(_escaped(TOKEN))),
}
# The token in a query parameter, as sent, escaped, or in the parameter's name.
QUERIES = {
    "plain": f"api_key={TOKEN}",
    "escaped": f"x=1&token={_escaped(TOKEN)}&y=2",
    "in the name": f"{TOKEN}=1",
}


def _holds_token(seen: Seen) -> list[tuple[str, str]]:
    """The headers of one request that hold the token, raw or as a Basic credential."""
    found = []
    for name, value in seen.headers:
        scheme, _, rest = value.replace("\t", " ").partition(" ")
        decoded = (
            base64.b64decode("".join(rest.split()) + "==").decode("utf-8", "replace")
            if scheme.lower() == "basic"
            else ""
        )
        unescaped = unquote(unquote(value))
        if TOKEN in name or TOKEN in value or TOKEN in decoded or TOKEN in unescaped:
            found.append((name, value))
    return found


@asynccontextmanager
async def engine_view(
    tmp_path: Path, **overrides: Any
) -> AsyncIterator[tuple[str, Capture, aiohttp.ClientSession]]:
    """A llama.cpp simulator behind a capturing hop behind a sidecar with an admin token."""
    (tmp_path / "slots").mkdir()
    async with (
        sim(fast("llamacpp", slot_save_path=str(tmp_path / "slots"))) as engine,
        capturing(engine.url) as capture,
        serve_sidecar(capture.url, tmp_path, engine="llamacpp", admin_token=TOKEN, **overrides) as sidecar,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        yield sidecar.url, capture, http


def _this_call(capture: Capture, before: int, path: str) -> Seen:
    """The one request the engine saw for `path` since `before` (health probes aside)."""
    seen = [x for x in capture.seen[before:] if x.raw_path == path]
    assert len(seen) == 1, capture.paths()[before:]
    return seen[0]


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
async def test_no_spelling_of_the_admin_token_reaches_the_engine(tmp_path: Path, spelling: str) -> None:
    name, value = SPELLINGS[spelling]
    async with engine_view(tmp_path) as (url, capture, http):
        # Forwarded traffic: the header is dropped, the rest goes on.
        before = len(capture.seen)
        async with http.post(
            f"{url}/v1/chat/completions", json=chat("hello"), headers={name: value, "X-Keep": "kept"}
        ) as resp:
            assert resp.status == 200
        seen = _this_call(capture, before, "/v1/chat/completions")
        assert _holds_token(seen) == [], spelling
        assert ("X-Keep", "kept") in seen.headers
        # A control call the admin made (the odd header beside the real bearer): neither goes on.
        if name.lower() != "authorization":
            before = len(capture.seen)
            headers = {"Authorization": f"Bearer {TOKEN}", name: value}
            async with http.get(f"{url}/slots", headers=headers) as resp:
                assert resp.status == 200
            assert _holds_token(_this_call(capture, before, "/slots")) == [], spelling


async def test_control_calls_carry_the_engines_key_and_no_spelling_of_the_token(tmp_path: Path) -> None:
    async with engine_view(tmp_path, upstream_api_key=ENGINE_KEY) as (url, capture, http):
        before = len(capture.seen)
        headers = {"Authorization": f"Bearer {TOKEN}", "x-api-key": TOKEN, "Cookie": f"s={TOKEN}"}
        async with http.post(
            f"{url}/slots/0?action=save", headers=headers, json={"filename": "a.bin"}
        ) as resp:
            assert resp.status == 200, await resp.text()
        seen = _this_call(capture, before, "/slots/0?action=save")
    assert seen.authorization == (f"Bearer {ENGINE_KEY}",)
    assert _holds_token(seen) == []


async def test_a_request_without_the_token_is_forwarded_unchanged(tmp_path: Path) -> None:
    async with engine_view(tmp_path) as (url, capture, http):
        before = len(capture.seen)
        headers = {"Authorization": "Bearer client-key", "x-api-key": "client-key", "Cookie": "a=b"}
        async with http.get(f"{url}/v1/models", headers=headers) as resp:
            assert resp.status == 200
        seen = _this_call(capture, before, "/v1/models")
    assert {(k, v) for k, v in seen.headers} >= set(headers.items())


@pytest.mark.parametrize("query", sorted(QUERIES))
async def test_the_admin_token_in_the_query_never_reaches_the_engine(tmp_path: Path, query: str) -> None:
    """The parameter that holds the token goes; the path and the other parameters go on."""
    async with engine_view(tmp_path) as (url, capture, http):
        before = len(capture.seen)
        target = URL(
            f"{url}/v1/chat/completions?{QUERIES[query]}", encoded=True
        )  # as written, not re-encoded
        async with http.post(target, json=chat("hello")) as resp:
            assert resp.status == 200
        seen = [x for x in capture.seen[before:] if x.raw_path.startswith("/v1/chat/completions")]
    assert len(seen) == 1
    assert TOKEN not in unquote(unquote(seen[0].raw_path)), seen[0].raw_path
    others = [p for p in QUERIES[query].split("&") if TOKEN not in unquote(p)]
    assert seen[0].raw_path == "/v1/chat/completions" + ("?" + "&".join(others) if others else "")


async def test_through_serve_no_new_spelling_nor_dot_segment_reaches_the_engine(tmp_path: Path) -> None:
    """`python -m proxy serve` with a token before a captured SGLang simulator (issue 45): the new
    header spellings and the query spellings reach the engine without the token, and `/dumper/.`
    (folded: `/dumper`, outside the `/dumper/` prefix) is refused."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    new = [spelling for spelling in SPELLINGS if "percent" in spelling or "whitespace" in spelling]
    async with sim(fast("sglang")) as engine, capturing(engine.url) as capture:
        process, url = await start_sidecar(
            capture.url, tmp_path, "--engine", "sglang", "--admin-token-file", str(token_file)
        )
        try:
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
                for spelling in new:
                    name, value = SPELLINGS[spelling]
                    async with http.post(
                        f"{url}/v1/chat/completions", json=chat("hi"), headers={name: value}
                    ) as r:
                        assert r.status == 200, spelling
                for query in QUERIES.values():
                    target = URL(f"{url}/v1/chat/completions?{query}", encoded=True)
                    async with http.post(target, json=chat("hi")) as r:
                        assert r.status == 200, query
                async with http.post(URL(f"{url}/dumper/.", encoded=True), json={}) as r:
                    dumper_status = r.status
        finally:
            await stop(process)
    seen = [x for x in capture.seen if x.raw_path.startswith("/v1/chat/completions")]
    assert len(seen) == len(new) + len(QUERIES)
    assert [x.raw_path for x in seen if _holds_token(x) or TOKEN in unquote(unquote(x.raw_path))] == []
    assert dumper_status == 401
    assert not [x for x in capture.seen if x.raw_path.startswith("/dumper")]
