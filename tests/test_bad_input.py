"""Bytes a client should not send cost no record and no 500: ids escaped, the rest a clear 400/401.

Raw sockets, because HTTP client libraries refuse to send these bytes at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote_to_bytes

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.sim import running_sim
from tests.support.sidecar import SidecarFactory
from tests.support.sim import chat, fast, words
from tests.support.upstream import STATE

BODY = orjson.dumps(chat(words(40)))


async def raw_exchange(url: str, head: bytes, body: bytes = BODY) -> tuple[int, dict[str, str], bytes]:
    """Send one request as raw bytes (head: request line and headers); read the whole answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            head + b"Host: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=30)  # the server closes: bounded
    finally:
        writer.close()
    head_bytes, _, payload = answer.partition(b"\r\n\r\n")
    status_line, *lines = head_bytes.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, payload


async def evidence(http: aiohttp.ClientSession, proxy: str, **filters: str) -> list[dict[str, Any]]:
    async with http.get(proxy + "/cache/evidence", params=filters) as response:
        assert response.status == 200, await response.text()
        return [orjson.loads(line) for line in (await response.read()).splitlines()]


class _Kept(logging.Handler):
    """A handler that keeps the records it is given."""

    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.WARNING)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def warnings_logged() -> Iterator[list[logging.LogRecord]]:
    """Every WARNING-or-worse record of the sidecar's and aiohttp's loggers while the test runs."""
    records: list[logging.LogRecord] = []
    handler = _Kept(records)
    loggers = [logging.getLogger("cachewitness"), logging.getLogger("aiohttp")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


# Invalid UTF-8, a tab, a C1 control (NEL), a space, a '%': all outside the id charset.
SESSION = b"run\xff\xc3\xa9\t1"
CASE = b"c\xc2\x85 1%"
REQUEST = b"r\xc3\x28-1"


async def test_ids_outside_the_charset_are_stored_escaped_and_nothing_is_dropped(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with running_sim(fast("vllm")) as engine:
        proxy = await sidecar(engine)
        async with http.post(proxy + "/cache/reset", json={"session_id": "s1", "case_id": "a"}) as response:
            assert (await response.json())["answer"] == "acknowledged"
        # The first request after the reset: it decides the verdict, whose record names it.
        status, _, _ = await raw_exchange(
            proxy,
            b"POST /v1/chat/completions HTTP/1.1\r\n"
            + b"X-Session-Id: %s\r\nX-Case-Id: %s\r\nX-Request-Id: %s\r\n" % (SESSION, CASE, REQUEST),
        )
        assert status == 200
        [observation] = await evidence(http, proxy, event_type="infer.cache_observation")
        [verification] = await evidence(http, proxy, event_type="infer.cache_verification")
        # The stored (escaped) id is a valid filter and finds the record.
        found = await evidence(http, proxy, session_id=observation["session_id"])
        async with http.get(proxy + "/cache/state") as response:
            sidecar_state = (await response.json())["sidecar"]
    assert observation["session_id"] == "run%FF%C3%A9%091"
    assert observation["case_id"] == "c%C2%85%201%25"
    assert observation["request_id"] == "r%C3%28-1"
    # Escaping loses nothing: the stored form gives back the bytes that were sent.
    assert unquote_to_bytes(observation["session_id"]) == SESSION
    assert unquote_to_bytes(observation["case_id"]) == CASE
    assert observation["outcome"] == "ok" and observation["ordinal_since_reset"] == 1
    assert verification["request_id"] == "r%C3%28-1" and verification["verdict"] == "consistent"
    assert verification["session_id"] == "s1"
    assert found == [observation]
    assert sidecar_state["evidence_dropped_total"] == 0


async def test_id_headers_that_are_not_utf8_reach_the_engine_escaped_and_others_unchanged(
    sidecar: SidecarFactory, upstream: str
) -> None:
    proxy = await sidecar(upstream)
    status, _, payload = await raw_exchange(
        proxy,
        b"POST /echo HTTP/1.1\r\nX-Session-Id: s\xff1\r\nX-Case-Id: caf\xc3\xa9\r\n"
        b"Authorization: Bearer \xe2\x82\xac-key\r\n",
    )
    assert status == 200
    seen = {name.lower(): value.encode("latin-1") for name, value in orjson.loads(payload)["headers"]}
    assert seen["x-session-id"] == b"s%FF1"  # not UTF-8: no client library could send it on as is
    assert seen["x-case-id"] == b"caf\xc3\xa9"  # valid UTF-8 goes on byte for byte
    assert seen["authorization"] == b"Bearer \xe2\x82\xac-key"


def one_refusal_logged(records: list[logging.LogRecord]) -> logging.LogRecord:
    """Exactly one warning, no error, no traceback."""
    assert [r.levelno for r in records] == [logging.WARNING], [r.getMessage() for r in records]
    assert records[0].exc_info is None
    return records[0]


@pytest.mark.parametrize(
    ("head", "code"),
    [
        (b"POST http://x/v1/chat/completions HTTP/1.1\r\n", "invalid_request_target"),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer \xff\xfe-key\r\n",
            "invalid_header_encoding",
        ),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer caf\xe9\r\n",
            "invalid_header_encoding",
        ),
    ],
    ids=["absolute-form-target", "authorization-not-utf8", "authorization-latin1"],
)
async def test_what_cannot_be_forwarded_gets_a_400_a_record_and_one_log_line(
    sidecar: SidecarFactory,
    upstream_app: web.Application,
    upstream: str,
    http: aiohttp.ClientSession,
    warnings_logged: list[logging.LogRecord],
    head: bytes,
    code: str,
) -> None:
    proxy = await sidecar(upstream)
    seen = upstream_app[STATE].seen
    seen.clear()
    warnings_logged.clear()
    status, headers, payload = await raw_exchange(proxy, head + b"X-Request-Id: bad-1\r\n")
    logged = one_refusal_logged(warnings_logged)
    assert status == 400 and headers["content-type"].startswith("application/json")
    error = orjson.loads(payload)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code
    assert b"key" not in payload and b"caf" not in payload  # a credential is never echoed
    assert seen == []  # the engine never saw it
    [record] = await evidence(http, proxy, event_type="infer.cache_observation")
    assert (record["status"], record["outcome"], record["request_id"]) == (400, "rejected", "bad-1")
    assert record["path"] == "/v1/chat/completions" and record["reset_id"] is None
    assert code in logged.getMessage() and getattr(logged, "request_id", None) == "bad-1"
    async with http.post(proxy + "/v1/chat/completions", json=chat("still serving")) as response:
        assert response.status == 200


async def test_admin_token_that_is_not_utf8_is_a_401_not_a_500(
    sidecar: SidecarFactory, upstream: str, warnings_logged: list[logging.LogRecord]
) -> None:
    proxy = await sidecar(upstream, admin_token="the-token")
    for token in (b"\xff\xfe", b"caf\xe9", b"\xe2\x82\xac"):
        status, _, payload = await raw_exchange(
            proxy, b"GET /cache/state HTTP/1.1\r\nAuthorization: Bearer %s\r\n" % token, body=b""
        )
        assert status == 401
        assert orjson.loads(payload)["error"]["code"] == "invalid_admin_token"
    assert [r for r in warnings_logged if r.levelno >= logging.ERROR or r.exc_info] == []


async def test_inference_request_over_the_body_limit_gets_a_413_and_its_record(
    sidecar: SidecarFactory, upstream: str, http: aiohttp.ClientSession
) -> None:
    proxy = await sidecar(upstream, max_body_bytes=100)
    status, _, payload = await raw_exchange(
        proxy, b"POST /v1/chat/completions HTTP/1.1\r\nX-Request-Id: big-1\r\nX-Case-Id: c1\r\n", b"x" * 101
    )
    assert status == 413 and orjson.loads(payload)["error"]["code"] == "request_too_large"
    [record] = await evidence(http, proxy, event_type="infer.cache_observation")
    assert (record["status"], record["outcome"], record["request_id"]) == (413, "rejected", "big-1")
    assert record["case_id"] == "c1" and record["model"] is None
