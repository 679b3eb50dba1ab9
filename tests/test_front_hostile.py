"""Heads built to hurt the front (issue 45), sent to `python -m proxy serve` over raw sockets.

Each is answered (by the front or by aiohttp, as a plain client would be), promptly, and the
sidecar keeps serving the next client; what a client's bytes make the libraries log stays small.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from pathlib import Path

import aiohttp
import orjson
import pytest
from multidict import CIMultiDictProxy

from proxy.inbound.choice import TAKEN, choose, plain_target
from proxy.inbound.head import parse_head
from proxy.sim import running_sim
from tests.support.client import CLIENT_TIMEOUT
from tests.support.process import open_raw, start_sidecar, stop
from tests.support.sim import chat, fast

# Far above what any of these takes when it works (a few ms); a loop held by a regex never gets there.
_PROMPT_S = 5.0
# Characters no plain target holds: each ends the letters before it after the front's target check ran.
_REFUSED = "?%;:@!$&'()*+,=\\[]|^`{}\"<>"


async def _answer(url: str, request: bytes) -> bytes:
    """What the sidecar sends back for `request` (with `Connection: close`) before it closes, bounded."""
    reader, writer = await open_raw(url, request)
    try:
        return await asyncio.wait_for(reader.read(), timeout=_PROMPT_S)
    finally:
        writer.close()


async def _stop_even_frozen(process: asyncio.subprocess.Process) -> None:
    """SIGTERM; a sidecar whose loop is held (a planted regex) cannot act on it and is killed."""
    try:
        await asyncio.wait_for(stop(process), timeout=_PROMPT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


async def _chat_ok(url: str) -> None:
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session,
        session.post(url + "/v1/chat/completions", json=chat("still serving")) as response,
    ):
        assert response.status == 200


class _AnyPost:
    """The app's side of the choice, taking any plain POST: the head's own rules alone decide."""

    max_body = 1024 * 1024
    own: tuple[str, ...] = ()

    def fits(self, size: int) -> bool:
        return True

    def holds_admin_token(self, headers: CIMultiDictProxy[str]) -> bool:
        return False

    def forwards(self, method: str, path: str, query: Mapping[str, str]) -> bool:
        return True


def _taken(raw: bytes) -> bool:
    """Whether the front takes the request with this head (proxy/inbound/choice.py)."""
    return choose(parse_head(raw), _AnyPost()) is TAKEN


def test_the_plain_target_check_takes_what_it_took_and_refuses_the_rest() -> None:
    """The front's target check: origin-form paths of plain segments; anything else is aiohttp's."""
    taken = ["/", "/v1/chat/completions", "/v1/chat/completions/", "/a.b/c_d/~e-f", "/x" * 300 + "/"]
    refused = ["", "v1", "//", "/a//b", "/a/./b", "/.hidden", "/a/..", "/a?b", "/a%62", "/a;b", "/a:b", "/é"]
    assert [target for target in taken if not plain_target(target)] == []
    assert [target for target in refused if plain_target(target)] == []
    long_segment = "/" + "a" * 40
    assert plain_target(long_segment)
    assert not any(plain_target(long_segment + refused_char) for refused_char in _REFUSED)
    # The 79-byte head of the finding: declined (aiohttp and the route policy judge it).
    head = b"POST /" + b"a" * 31 + b"? HTTP/1.1\r\nHost: s\r\nContent-Length: 2\r\n\r\n"
    assert not _taken(head)


_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\nContent-Length: 2\r\n"


@pytest.mark.parametrize(
    ("case", "extra"),
    [
        (
            "a 40 KB head of 7,000-byte values",
            b"".join(b"X-N%d: %b\r\n" % (i, b"n" * 7000) for i in range(6)),
        ),
        ("129 headers", b"".join(b"X-N%d: n\r\n" % i for i in range(129))),
        ("an 8,191-byte value", b"X-Note: " + b"n" * 8191 + b"\r\n"),
        ("two Hosts", b"Host: t\r\n"),
    ],
)
def test_a_complete_head_past_the_limits_is_declined(case: str, extra: bytes) -> None:
    """The 32 KiB head limit, aiohttp's 8,190 bytes a field and 128 headers hold for a complete head
    too, and an HTTP/1.1 head has one Host: else aiohttp judges it. The same head within them is taken."""
    assert not _taken(_HEAD + extra + b"\r\n"), case
    assert _taken(_HEAD + b"\r\n")
    assert not _taken(_HEAD.replace(b"Host: s\r\n", b"") + b"\r\n")
    assert _taken(_HEAD + b"".join(b"X-N%d: %b\r\n" % (i, b"n" * 7000) for i in range(4)) + b"\r\n")


_REFUSED_HEADS = {
    "no Host": _HEAD.replace(b"Host: s\r\n", b""),
    "two Hosts": _HEAD + b"Host: t\r\n",
    "a 20 KB value": _HEAD + b"X-Note: " + b"n" * 20_000 + b"\r\n",
    "1,000 headers": _HEAD + b"".join(b"X-N%d: n\r\n" % i for i in range(1000)),
}


async def test_heads_aiohttp_refuses_are_refused_with_the_front_on(tmp_path: Path) -> None:
    """Each goes to aiohttp, which answers 400 (the front served them all to the engine), and the
    sidecar serves the next client."""
    async with running_sim(fast("vllm")) as engine:
        process, url = await start_sidecar(engine, tmp_path)
        try:
            answers = {
                case: await _answer(url, head + b"Connection: close\r\n\r\n{}")
                for case, head in _REFUSED_HEADS.items()
            }
            await _chat_ok(url)
        finally:
            await _stop_even_frozen(process)
    # aiohttp's own refusal (HTTP/1.0, text/plain), not the engine's JSON 400 to what the front forwarded.
    refused = {
        case: answer.startswith(b"HTTP/1.0 400 ") and b"text/plain" in answer
        for case, answer in answers.items()
    }
    assert refused == dict.fromkeys(_REFUSED_HEADS, True), answers


async def test_a_long_segment_then_a_refused_character_is_answered_promptly(tmp_path: Path) -> None:
    """`POST /` + 40 letters + a refused character: answered within seconds (a backtracking regex
    held the loop 2^39 steps), and the sidecar serves the next client."""
    async with running_sim(fast("vllm")) as engine:
        process, url = await start_sidecar(engine, tmp_path)
        try:
            for refused in _REFUSED:
                target = ("/" + "a" * 40 + refused).encode()
                request = b"POST " + target + b" HTTP/1.1\r\nHost: s\r\nConnection: close\r\n"
                answer = await _answer(url, request + b"Content-Length: 2\r\n\r\n{}")
                assert answer.startswith(b"HTTP/1.1 "), (refused, answer[:100])
            await _chat_ok(url)
        finally:
            await _stop_even_frozen(process)


_UPGRADES = {
    "upgrade": b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\nConnection: Upgrade, close\r\n"
    b"Upgrade: websocket\r\nContent-Length: 2\r\n\r\n{}",
    "connect": b"CONNECT engine:443 HTTP/1.1\r\nHost: engine:443\r\nConnection: close\r\n\r\n",
    # aiohttp logs a traceback for each malformed head it refuses (a space in a header name).
    "malformed": b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\nBad Name: x\r\nContent-Length: 2\r\n\r\n{}",
}


@pytest.mark.parametrize("case", sorted(_UPGRADES))
async def test_many_upgrade_and_connect_heads_are_all_answered_and_the_log_stays_small(
    tmp_path: Path, case: str
) -> None:
    """300 of one kind, 50 at a time: each answered (aiohttp's answer, as before the front), no
    traceback per request in the log (unthrottled: ~1 KB each)."""
    async with running_sim(fast("vllm")) as engine:
        process, url = await start_sidecar(engine, tmp_path)
        try:
            answers: list[bytes] = []
            for _ in range(6):
                answers += await asyncio.gather(*(_answer(url, _UPGRADES[case]) for _ in range(50)))
            await _chat_ok(url)
        finally:
            await _stop_even_frozen(process)
    assert [answer[:40] for answer in answers if not answer.startswith(b"HTTP/1.")] == []
    log = (tmp_path / "sidecar.log").read_text()
    assert len(log) < 20_000, log[-3000:]
    tracebacks = [orjson.loads(line) for line in log.splitlines() if '"exc"' in line]
    assert len(tracebacks) <= 2, tracebacks[-1]
