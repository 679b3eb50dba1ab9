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
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy.admission import ADMISSION
from proxy.config import SETTINGS
from proxy.engine_state import ENGINE
from proxy.errors import error_response
from proxy.exchange import Forwarded
from proxy.logs import log_event
from proxy.observe import (
    Observation,
    StreamScanner,
    is_observed,
    prepare_request,
    usage_from_json,
)
from proxy.pool import UPSTREAM_POOL
from proxy.recorder import RECORDER

__all__ = ["HOP_BY_HOP", "Exchange", "forward"]

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
# Validation failures (FastAPI's 422, plain 400) that may be our injected stream_options.
_REFUSED_INJECTION = frozenset({400, 422})
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
    upstream_sent_ns: int | None = None
    upstream_head_ns: int | None = None
    observed: bool = False
    stream: bool = False
    model: str | None = None
    usage_injected: bool = False
    reset_id: str | None = None
    ordinal: int | None = None
    scanner: StreamScanner | None = None
    json_parts: list[bytes] | None = None
    json_bytes: int = 0

    def forwarded(self, request: web.Request) -> Forwarded:
        """The transport facts of this exchange, once it is over."""
        sent, head, first = self.upstream_sent_ns, self.upstream_head_ns, self.first_byte_ns
        return Forwarded(
            method=request.method,
            path=request.path,
            status=self.status,
            outcome=self.outcome,
            started_ns=self.started_ns,
            first_byte_ns=first,
            finished_ns=time.time_ns(),
            before_upstream_s=(sent - self.started_ns) / 1e9 if sent is not None else None,
            after_upstream_s=(first - head) / 1e9 if first is not None and head is not None else None,
        )

    def observation(self, request: web.Request) -> Observation:
        """The frozen record of this exchange, once it is over."""
        usage = (
            self.scanner.usage
            if self.scanner is not None
            else usage_from_json(b"".join(self.json_parts) if self.json_parts is not None else b"")
        )
        return Observation(
            request_id=self.request_id,
            session_id=_tag(request.headers.get("X-Session-Id")),
            case_id=_tag(request.headers.get("X-Case-Id")),
            method=request.method,
            path=request.path,
            status=self.status,
            stream=self.stream,
            model=self.model,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            cached_tokens_source=usage.cached_tokens_source,
            reset_id=self.reset_id,
            ordinal_since_reset=self.ordinal,
            started_ns=self.started_ns,
            first_byte_ns=self.first_byte_ns,
            finished_ns=time.time_ns(),
            outcome=self.outcome,
            usage_injected=self.usage_injected,
        )


def _tag(value: str | None) -> str | None:
    """A session/case id from a header, bounded so a client cannot bloat the evidence."""
    return value[:128] if value else None


def _end_to_end(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """`headers` minus the hop-by-hop ones in `drop` and those named in their Connection header."""
    named = {
        token.strip().lower() for value in headers.getall("Connection", ()) for token in value.split(",")
    }
    kept: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lowered = name.lower()
        if lowered not in drop and lowered not in named:
            kept.add(name, value)
    return kept


def _request_headers(request: web.Request, request_id: str) -> CIMultiDict[str]:
    """The client's end-to-end headers, with the request id the engine will see."""
    headers = _end_to_end(request.headers, _REQUEST_DROP)
    if "X-Request-Id" not in headers:
        headers["X-Request-Id"] = request_id
    return headers


def _response_headers(upstream: aiohttp.ClientResponse, request_id: str) -> CIMultiDict[str]:
    """The engine's end-to-end headers, plus our request id and SSE flushing hint."""
    headers = _end_to_end(upstream.headers, HOP_BY_HOP)
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
    log_event(
        log,
        logging.WARNING,
        "upstream failure",
        request_id=exchange.request_id,
        status=status,
        error=type(exc).__name__,
    )
    exchange.status = status
    return error_response(status, f"{what} ({type(exc).__name__})", type_="upstream_error", code=code)


async def _read_bounded(request: web.Request, limit: int) -> bytes:
    """The whole request body (an inference request must be read to be observed), or BodyTooLarge."""
    parts: list[bytes] = []
    async for chunk in _limited_body(request, limit):
        parts.append(chunk)
    return b"".join(parts)


async def forward(request: web.Request) -> web.StreamResponse:
    """Proxy one request to the upstream and stream the answer back."""
    app = request.app
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    exchange = Exchange(request_id=request_id, started_ns=time.time_ns())
    try:
        return await _admit_and_exchange(request, exchange)
    finally:
        # Every request is counted, those the sidecar itself turned away (413, 503) included.
        app[RECORDER].forwarded(exchange.forwarded(request))


def _rejected(exchange: Exchange, response: web.Response) -> web.Response:
    """A request the sidecar answers itself, without the engine."""
    exchange.status = response.status
    exchange.outcome = "rejected"
    return response


async def _admit_and_exchange(request: web.Request, exchange: Exchange) -> web.StreamResponse:
    """Read what must be observed, pass the drain gate, then exchange with the upstream."""
    app = request.app
    settings = app[SETTINGS]
    limit = settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        return _rejected(exchange, _too_large(limit))
    body: bytes | None = None
    original: bytes | None = None
    if settings.observe and is_observed(request.method, request.path):
        try:
            body = await _read_bounded(request, limit)
        except BodyTooLarge:
            return _rejected(exchange, _too_large(limit))
        except ClientGone:
            exchange.outcome = "client_disconnected"
            raise asyncio.CancelledError from None
        # llama.cpp needs no injection: its finish chunk carries `timings.cache_n`, and its
        # /v1/completions streams may carry usage unasked, which stripping would then remove.
        inject = settings.inject_usage and app[ENGINE].info.kind != "llamacpp"
        prepared = prepare_request(body, inject_usage=inject, path=request.path)
        original = body
        body = prepared.body
        exchange.observed = True
        exchange.stream = prepared.stream
        exchange.model = prepared.model
        exchange.usage_injected = prepared.usage_injected
    admission = app[ADMISSION]
    if not await admission.admit():
        return _rejected(
            exchange,
            error_response(
                503,
                "the sidecar held this request while a cache reset drained the engine, and the wait ran out",
                type_="service_unavailable",
                code="draining",
            ),
        )
    try:
        if exchange.observed:
            # Assigned after admission: a request held during a drain belongs to the new reset.
            exchange.reset_id, exchange.ordinal = app[RECORDER].begin_request()
        return await _exchange(request, exchange, body, settings.upstream_base, limit, original=original)
    finally:
        admission.leave()
        if exchange.observed:
            app[RECORDER].observation(exchange.observation(request))


async def _exchange(
    request: web.Request,
    exchange: Exchange,
    body: bytes | None,
    base: str,
    limit: int,
    *,
    original: bytes | None = None,
) -> web.StreamResponse:
    """Send the request upstream and relay the answer; the admission slot is held throughout.

    `original` is the client's own body when `body` has include_usage injected: an engine
    that refuses the injected request gets the client's request instead.
    """
    client = request.app[UPSTREAM_POOL]
    url = URL(base + request.raw_path, encoded=True)
    headers = _request_headers(request, exchange.request_id)
    data: bytes | AsyncIterator[bytes] | None
    if body is not None:
        data = body
        # The body may have been rewritten (include_usage injected): its length is ours to say.
        headers["Content-Length"] = str(len(body))
    else:
        data = _limited_body(request, limit) if request.body_exists else None
    exchange.upstream_sent_ns = time.time_ns()
    try:
        upstream = await client.request(
            request.method, url, headers=headers, data=data, allow_redirects=False
        )
    except BodyTooLarge:
        return _rejected(exchange, _too_large(limit))
    except ClientGone:
        exchange.outcome = "client_disconnected"
        raise asyncio.CancelledError from None
    except asyncio.CancelledError:
        exchange.outcome = "client_disconnected"
        raise
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, (BodyTooLarge, ClientGone)) else None
        if isinstance(cause, BodyTooLarge):
            return _rejected(exchange, _too_large(limit))
        return _upstream_failure(exc, exchange)
    exchange.upstream_head_ns = time.time_ns()
    if exchange.usage_injected and original is not None and upstream.status in _REFUSED_INJECTION:
        # A strict OpenAI-compatible engine may reject `stream_options` it does not know; the
        # client must not fail because of us, so it gets the engine's answer to its own request.
        upstream.close()
        exchange.usage_injected = False
        log_event(
            log,
            logging.INFO,
            "engine refused the injected include_usage; sent the client's body",
            request_id=exchange.request_id,
            status=upstream.status,
        )
        return await _exchange(request, exchange, original, base, limit)
    try:
        return await _relay(request, upstream, exchange, limit)
    finally:
        # close(), not release(): the connection must not go back to the pool half-read, and
        # closing it is what tells the engine to abort the sequence (production-stack #634).
        upstream.close()


def _start_observing(upstream: aiohttp.ClientResponse, exchange: Exchange) -> None:
    """Pick how the answer is read for usage: SSE scanner, or a bounded copy of the JSON."""
    if not exchange.observed:
        return
    if upstream.content_type == "text/event-stream":
        exchange.scanner = StreamScanner(strip_injected=exchange.usage_injected)
    else:
        exchange.json_parts = []


async def _relay(
    request: web.Request, upstream: aiohttp.ClientResponse, exchange: Exchange, limit: int
) -> web.StreamResponse:
    """Stream the upstream's answer to the client chunk by chunk."""
    exchange.status = upstream.status
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    response.headers.extend(_response_headers(upstream, exchange.request_id))
    _start_observing(upstream, exchange)
    scanner, parts = exchange.scanner, exchange.json_parts
    try:
        await response.prepare(request)
        exchange.first_byte_ns = time.time_ns()
        async for chunk in upstream.content.iter_any():
            if scanner is not None:
                chunk = scanner.feed(chunk)
                if not chunk:
                    continue
            elif parts is not None and exchange.json_bytes <= limit:
                parts.append(chunk)
                exchange.json_bytes += len(chunk)
            await response.write(chunk)
        if scanner is not None and (tail := scanner.finish()):
            await response.write(tail)
        await response.write_eof()
    except ConnectionResetError:
        # aiohttp's ClientConnectionResetError: the client left; closing upstream aborts the engine.
        exchange.outcome = "client_disconnected"
    except (TimeoutError, aiohttp.ClientError) as exc:
        exchange.outcome = "timeout" if isinstance(exc, asyncio.TimeoutError) else "upstream_error"
        log_event(
            log,
            logging.WARNING,
            "upstream broke mid-response",
            request_id=exchange.request_id,
            error=type(exc).__name__,
        )
        # The head is gone already: cut the client's connection so a truncated body is never
        # mistaken for a complete one.
        if request.transport is not None:
            request.transport.abort()
    except asyncio.CancelledError:
        exchange.outcome = "client_disconnected"
        raise
    if parts is not None and exchange.json_bytes > limit:
        exchange.json_parts = None  # too big to be a usage answer worth parsing
    return response
