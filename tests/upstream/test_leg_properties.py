"""Property: whatever an engine writes, in whatever pieces, no client gets bytes of another's answer.

One sidecar (`python -m proxy serve`, one engine connection at a time, 1 KiB head limit) in
front of an engine that answers each request with a script hypothesis draws: a valid answer
(with a length, chunked, until close, after a 1xx) or an invalid one (not HTTP, cut short,
bad chunk framing, a head past the limits or not relayable), written in random pieces, a
valid one followed in its last write by stray bytes (a second answer, the start of one whose
end comes later, junk). Every answer's body and `X-Answer-For` carry its request's id. The
client must get its own answer whole when the script's was valid, a 502 `upstream_bad_answer`
when the head was bad, a cut connection when the body was, and never a byte of another id's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.client import CLIENT_TIMEOUT
from tests.support.hostile_engine import OK_JSON, hostile_engine, path_of, query_of
from tests.support.process import start_sidecar

T = TypeVar("T")
HEAD_LIMIT = 1024  # the smallest max_upstream_head_bytes, so a drawn head can cross it


class Expect(Enum):
    """What the client must get for a script."""

    WHOLE = "its own answer, whole"
    BAD_HEAD = "502 upstream_bad_answer"
    CUT = "its own head, a prefix of its own body, then a cut connection"


@dataclass(frozen=True)
class Scripted:
    """One request's answer: the pieces the engine writes, whether it closes after, what the client gets."""

    pieces: tuple[bytes, ...]
    close: bool
    expect: Expect
    body: bytes  # the body the answer carries (all of it for WHOLE, at most it for CUT)


def _body(ident: int, copies: int) -> bytes:
    return f"<{ident}>".encode() * copies


def _head(ident: int, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 " + status + b"\r\nX-Answer-For: %d\r\n" % ident + extra


def _answer(kind: str, ident: int, copies: int, pad: int) -> tuple[bytes, bool, Expect, bytes]:
    """The bytes of one answer of `kind` for request `ident` (`pad`: head size around the limit)."""
    body = _body(ident, copies)
    length = b"Content-Length: %d\r\n\r\n" % len(body)
    if kind == "length":
        return _head(ident, extra=length) + body, False, Expect.WHOLE, body
    if kind == "chunked":
        chunks = b"".join(b"%x\r\n%b\r\n" % (len(part), part) for part in (body[:3], body[3:]) if part)
        return (
            _head(ident, extra=b"Transfer-Encoding: chunked\r\n\r\n") + chunks + b"0\r\n\r\n",
            False,
            Expect.WHOLE,
            body,
        )
    if kind == "until-close":
        return _head(ident, extra=b"\r\n") + body, True, Expect.WHOLE, body
    if kind == "early-hints":
        hints = b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n"
        return hints + _head(ident, extra=length) + body, False, Expect.WHOLE, body
    if kind == "sized-head":  # a head of exactly HEAD_LIMIT + pad bytes
        start = _head(ident, extra=b"X-Pad: ")
        end = b"\r\n" + length
        filler = b"p" * (HEAD_LIMIT + pad - len(start) - len(end))
        fits = pad <= 0
        return start + filler + end + body, False, Expect.WHOLE if fits else Expect.BAD_HEAD, body
    if kind == "not-http":
        return b"SSH-2.0-OpenSSH_9.6\r\n" + body, False, Expect.BAD_HEAD, b""
    if kind == "many-headers":
        many = b"".join(b"X-%d: %d\r\n" % (index, index) for index in range(100))
        return _head(ident, extra=many + length) + body, False, Expect.BAD_HEAD, b""
    if kind == "control-reason":
        return _head(ident, status=b"200 O\x07K", extra=length) + body, False, Expect.BAD_HEAD, b""
    if kind == "latin1-header":
        return _head(ident, extra=b"X-Name: caf\xe9\r\n" + length) + body, False, Expect.BAD_HEAD, b""
    if kind == "cut-short":
        return (
            _head(ident, extra=b"Content-Length: %d\r\n\r\n" % (len(body) + 5)) + body,
            True,
            Expect.CUT,
            body,
        )
    if kind == "bad-chunk":
        framed = b"%x\r\n%b\r\n" % (len(body), body)
        return (
            _head(ident, extra=b"Transfer-Encoding: chunked\r\n\r\n") + framed + b"zz\r\n",
            False,
            Expect.CUT,
            body,
        )
    raise AssertionError(kind)


VALID_KINDS = ("length", "chunked", "until-close", "early-hints")
KINDS = (
    *VALID_KINDS,
    "sized-head",
    "not-http",
    "many-headers",
    "control-reason",
    "latin1-header",
    "cut-short",
    "bad-chunk",
)
STRAYS = ("none", "blank-line", "second-answer", "half-a-head", "junk")


def _stray(kind: str, ident: int) -> tuple[bytes, bytes]:
    """Bytes after a valid answer: those in its last write, and those written a moment later."""
    tag = b"<%d>" % ident
    second = _head(ident, extra=b"Content-Length: %d\r\n\r\n" % len(tag)) + tag
    return {
        "none": (b"", b""),
        "blank-line": (b"\r\n", b""),
        "second-answer": (second, b""),
        "half-a-head": (second[:20], second[20:]),
        "junk": (b"junk", b""),
    }[kind]


@dataclass(frozen=True)
class Recipe:
    """What hypothesis draws for one request; its bytes are made with the request's id."""

    kind: str
    copies: int  # of the id tag in the body
    pad: int  # sized-head: the head is HEAD_LIMIT + pad bytes
    stray: str  # after a valid answer that keeps the connection
    cuts: tuple[int, ...]  # where the answer's bytes are cut into pieces


RECIPES = st.builds(
    Recipe,
    kind=st.sampled_from(KINDS),
    copies=st.integers(1, 300),  # up to 1.8 KB: reads that cross the head limit with a whole head in them
    pad=st.integers(-2, 2),
    stray=st.sampled_from(STRAYS),
    cuts=st.lists(st.integers(1, 2000), max_size=5).map(tuple),
)


def script(recipe: Recipe, ident: int) -> Scripted:
    """The engine's answer to request `ident`, in pieces: stray bytes go with the answer's last
    byte, in one write, so that they arrive in the read that ends it."""
    whole, close, expect, body = _answer(recipe.kind, ident, recipe.copies, recipe.pad)
    now, later = b"", b""
    if recipe.kind in VALID_KINDS and not close:
        now, later = _stray(recipe.stray, ident)
    cuts = sorted({cut for cut in recipe.cuts if cut < len(whole)})
    whole += now
    pieces = tuple(whole[start:end] for start, end in itertools.pairwise([0, *cuts, len(whole)]))
    return Scripted(pieces + ((later,) if later else ()), close, expect, body)


class Rig:
    """A loop in its own thread, running the engine and the client, and the sidecar in front."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        proxy: str,
        scripts: dict[int, Scripted],
        http: aiohttp.ClientSession,
    ) -> None:
        self.loop, self.proxy, self.scripts, self.http = loop, proxy, scripts, http
        self.ids = itertools.count()  # new in every example: bytes left from an earlier one would show

    def __repr__(self) -> str:  # hypothesis prints it with a failing example: not every script
        return f"Rig({self.proxy})"

    def run(self, work: Coroutine[Any, Any, T], bound_s: float) -> T:
        """Run `work` on the rig's loop from the test's thread, within `bound_s`."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(bound_s)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """One engine and one sidecar for every example (so that examples also follow each other)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    scripted: dict[int, Scripted] = {}

    async def answer(head: bytes, writer: asyncio.StreamWriter) -> bool:
        if path_of(head) != "/v1/tagged":
            writer.write(OK_JSON)  # detection and health
            return True
        script = scripted[int(query_of(head))]
        for index, piece in enumerate(script.pieces):
            if index:
                await asyncio.sleep(0.002)  # each piece in its own read, most of the time
            writer.write(piece)
            await writer.drain()
        return not script.close

    stack = contextlib.AsyncExitStack()

    async def start() -> Rig:
        engine = await stack.enter_async_context(hostile_engine(answer))
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        process, proxy = await start_sidecar(
            engine.url,
            tmp_path_factory.mktemp("sidecar"),
            *("--engine", "vllm", "--upstream-connection-limit", "1", "--read-timeout", "10"),
            *("--max-upstream-head-bytes", str(HEAD_LIMIT)),
        )
        stack.push_async_callback(_stopped, process)
        return Rig(loop, proxy, scripted, http)

    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    finally:
        asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _stopped(process: asyncio.subprocess.Process) -> None:
    process.terminate()
    await asyncio.wait_for(process.wait(), timeout=20)


@dataclass(frozen=True)
class Got:
    """What one client got."""

    status: int
    answer_for: str | None
    body: bytes
    cut: bool
    code: str | None


async def _ask(rig: Rig, ident: int) -> Got:
    """One request; a connection cut before the head is status 0."""
    async with asyncio.timeout(30):
        try:
            async with rig.http.get(f"{rig.proxy}/v1/tagged?{ident}") as response:
                body, cut = b"", False
                try:
                    async for chunk in response.content.iter_any():
                        body += chunk
                except aiohttp.ClientPayloadError:
                    cut = True
                code = orjson.loads(body)["error"]["code"] if response.status == 502 else None
                return Got(response.status, response.headers.get("X-Answer-For"), body, cut, code)
        except aiohttp.ClientConnectionError:
            return Got(0, None, b"", True, None)


def _check(ident: int, script: Scripted, got: Got) -> None:
    """The client's own answer or an error, never another's bytes."""
    assert got.answer_for in (None, str(ident)), (ident, got)
    if script.expect is Expect.WHOLE:
        assert (got.status, got.answer_for, got.body, got.cut) == (200, str(ident), script.body, False), got
    elif script.expect is Expect.BAD_HEAD:
        assert (got.status, got.code) == (502, "upstream_bad_answer"), got
    else:
        assert got.status in (0, 200) and got.cut, got
        assert script.body.startswith(got.body), (ident, got)


@settings(max_examples=75)
@given(recipes=st.lists(RECIPES, min_size=1, max_size=4))
def test_no_client_ever_gets_bytes_of_another_request_s_answer(rig: Rig, recipes: list[Recipe]) -> None:
    idents = [next(rig.ids) for _ in recipes]
    for ident, recipe in zip(idents, recipes, strict=True):
        rig.scripts[ident] = script(recipe, ident)

    async def all_at_once() -> list[Got]:
        return await asyncio.gather(*(_ask(rig, ident) for ident in idents))

    for ident, got in zip(idents, rig.run(all_at_once(), bound_s=60), strict=True):
        _check(ident, rig.scripts[ident], got)
