"""The streaming reverse proxy handler: everything the sidecar does not own goes upstream."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from proxy.errors import error_response
from proxy.keys import ADMISSION, CLIENT, SETTINGS
from proxy.logs import log_event

__all__ = ["forward", "HOP_BY_HOP", "Exchange"]

log = logging.getLogger("cachewitness.forward")

# RFC 9110 §7.6.1 connection-specific fields, plus the de-facto ones proxies drop.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_REQUEST_DROP = HOP_BY_HOP | {"host"}
_CHUNK = 64 * 1024


class BodyTooLarge(Exception):
    """The client's request body passed `max_body_bytes`."""


class ClientGone(Exception):
    """The client went away while its body was being read."""


@dataclass
class Exchange:
    """Mutable facts about one forwarded exchange, filled in as it goes."""

    request_id: str
    started_ns: int
    status: int | None = None
    first_byte_ns: int | None = None
    outcome: str = "ok"
    upstream_ms: float = 0.0


def _request_headers(request: web.Request, request_id: str) -> CIMultiDict[str]:
    """The client's headers minus hop-by-hop ones (and those named in Connection)."""
    named = {
        token.strip().lower()
        for value in request.headers.getall("Connection", ())
        for token in value.split(",")
    }
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in request.headers.items():
        lowered = name.lower()
        if lowered in _REQUEST_DROP or lowered in named:
            continue
        headers.add(name, value)
    if "X-Request-Id" not in headers:
        headers["X-Request-Id"] = request_id
    return headers


def _response_headers(upstream: aiohttp.ClientResponse, request_id: str) -> CIMultiDict[str]:
    """The engine's headers minus hop-by-hop ones, plus our request id and SSE flushing hint."""
    named = {
        token.strip().lower()
        for value in upstream.headers.getall("Connection", ())
        for token in value.split(",")
    }
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.headers.items():
        lowered = name.lower()
        if lowered in HOP_BY_HOP or lowered in named:
            continue
        headers.add(name, value)
    headers.setdefault("X-Request-Id", request_id)
    if upstream.content_type == "text/event-stream":
        # nginx and other buffering proxies in front of us flush SSE at once (llama.cpp #24774).
        headers["X-Accel-Buffering"] = "no"
    return headers


async def _limited_body(request: web.Request, limit: int) -> AsyncIterator[bytes]:
    """Stream the client's body upstream, stopping once it passes `limit` bytes."""
    seen = 0
    while True:
        try:
            chunk = await request.content.readany()
        except (ConnectionError, aiohttp.ClientPayloadError) as exc:
            raise ClientGone(str(exc)) from exc
        if not chunk:
            return
        seen += len(chunk)
        if seen > limit:
            raise BodyTooLarge
        yield chunk


def _too_large(limit: int) -> web.Response:
    return error_response(
        413,
        f"request body is larger than max_body_bytes ({limit} bytes)",
        type_="invalid_request_error",
        code="request_too_large",
    )


def _upstream_failure(exc: BaseException, exchange: Exchange) -> web.Response:
    """Map an upstream failure before the response head to 502/504."""
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        exchange.outcome = "timeout"
        status, code, what = 504, "upstream_timeout", "the upstream did not answer in time"
    else:
        exchange.outcome = "upstream_error"
        status, code = 502, "upstream_unreachable"
        if isinstance(exc, aiohttp.ClientConnectorError):
            what = "the upstream refused the connection or cannot be reached"
        else:
            what = "the upstream broke the connection"
    log_event(log, logging.WARNING, "upstream failure", request_id=exchange.request_id,
              status=status, error=type(exc).__name__)
    exchange.status = status
    return error_response(status, f"{what} ({type(exc).__name__})", type_="upstream_error", code=code)


async def forward(request: web.Request) -> web.StreamResponse:
    """Proxy one request to the upstream and stream the answer back."""
    app = request.app
    settings = app[SETTINGS]
    admission = app[ADMISSION]
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    exchange = Exchange(request_id=request_id, started_ns=time.time_ns())
    limit = settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        return _too_large(limit)
    max_wait = settings.drain_timeout + settings.retry_seconds + settings.reset_attempt_timeout
    if not await admission.admit(max_wait):
        return error_response(
            503,
            "the sidecar held this request while a cache reset drained the engine, and the wait ran out",
            type_="service_unavailable",
            code="draining",
        )
    try:
        return await _exchange(request, exchange, settings.upstream_base, limit)
    finally:
        admission.leave()


async def _exchange(
    request: web.Request, exchange: Exchange, base: str, limit: int
) -> web.StreamResponse:
    """Send the request upstream and relay the answer; the admission slot is held throughout."""
    client = request.app[CLIENT]
    url = URL(base + request.raw_path, encoded=True)
    headers = _request_headers(request, exchange.request_id)
    data = _limited_body(request, limit) if request.body_exists else None
    try:
        upstream = await client.request(
            request.method, url, headers=headers, data=data, allow_redirects=False
        )
    except BodyTooLarge:
        return _too_large(limit)
    except ClientGone:
        exchange.outcome = "client_disconnected"
        raise asyncio.CancelledError from None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, (BodyTooLarge, ClientGone)) else None
        if isinstance(cause, BodyTooLarge):
            return _too_large(limit)
        return _upstream_failure(exc, exchange)
    try:
        return await _relay(request, upstream, exchange)
    finally:
        # close(), not release(): the connection must not go back to the pool half-read, and
        # closing it is what tells the engine to abort the sequence (production-stack #634).
        upstream.close()


async def _relay(
    request: web.Request, upstream: aiohttp.ClientResponse, exchange: Exchange
) -> web.StreamResponse:
    """Stream the upstream's answer to the client chunk by chunk."""
    exchange.status = upstream.status
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    response.headers.extend(_response_headers(upstream, exchange.request_id))
    try:
        await response.prepare(request)
        exchange.first_byte_ns = time.time_ns()
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
    except ConnectionResetError:
        # aiohttp's ClientConnectionResetError: the client left; closing upstream aborts the engine.
        exchange.outcome = "client_disconnected"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        exchange.outcome = "timeout" if isinstance(exc, asyncio.TimeoutError) else "upstream_error"
        log_event(log, logging.WARNING, "upstream broke mid-response", request_id=exchange.request_id,
                  error=type(exc).__name__)
        # The head is gone already: cut the client's connection so a truncated body is never
        # mistaken for a complete one.
        if request.transport is not None:
            request.transport.abort()
    except asyncio.CancelledError:
        exchange.outcome = "client_disconnected"
        raise
    return response
