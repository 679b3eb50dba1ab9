"""One request's exchange with the engine, from the drain gate to the last byte of its response.

Shared by both servers that take client requests (proxy/inbound/: the front, and aiohttp): each
reads the request its own way, then hands it here with its `ClientSide` (proxy/forward/client.py),
where the response goes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TypeVar

from aiohttp import web

from proxy.config import SETTINGS
from proxy.errors import error_response
from proxy.forward.client import BodyTooLarge, ClientGone, ClientSide
from proxy.forward.exchange import ClientRequest, Exchange
from proxy.forward.headers import CASE_HEADER, request_headers
from proxy.forward.injection_probe import INJECTION_PROBE, REFUSED_STATUSES, InjectionProbe
from proxy.forward.isolating import isolate
from proxy.forward.relay import relay
from proxy.forward.services import INJECTION_REFUSALS, SERVICES, Services, gather_services
from proxy.logs import log_event
from proxy.observe import (
    InjectionRefusals,
    PreparedRequest,
    is_observed,
    names_stream_options,
    prepare_request,
    rules_for,
)
from proxy.observe.overhead import elapsed_us
from proxy.upstream import Body, UpstreamBadResponse, UpstreamError, UpstreamResponse, UpstreamUnreachable
from proxy.vocabulary import Outcome, ServedBy

__all__ = [
    "INJECTION_REFUSALS",
    "admitted_exchange",
    "is_inference",
    "prepare",
    "record_finished",
    "rejected",
    "setup_forward",
    "too_large",
]

log = logging.getLogger("cachewitness.forward")

R = TypeVar("R")

_ERROR_PEEK = 64 * 1024
# An observed body past this goes upstream in pieces of the client's buffer, not one copy.
_CHUNK = 64 * 1024


def setup_forward(app: web.Application) -> None:
    """What forwarding keeps across requests: the engines that refused the injection, the probe
    that alone decides it, and the record of the app's objects each exchange reads."""
    refusals = InjectionRefusals(app[SETTINGS].inject_usage_reprobe_seconds)
    app[INJECTION_REFUSALS] = refusals
    probe = app[INJECTION_PROBE] = InjectionProbe(refusals)

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        """The exchange's record of the app's objects, gathered once the leg is open; a probe in
        flight is cancelled before the pool it uses closes."""
        app[SERVICES] = gather_services(app)
        yield
        await probe.stop()

    app.cleanup_ctx.append(lifetime)


def too_large(limit: int) -> web.Response:
    """The 413 for a body past max_body_bytes."""
    return error_response(
        413,
        f"request body is larger than max_body_bytes ({limit} bytes)",
        type_="invalid_request_error",
        code="request_too_large",
    )


def rejected(exchange: Exchange, response: web.Response) -> web.Response:
    """A request the sidecar answers itself, without the engine."""
    exchange.status = response.status
    exchange.outcome = Outcome.REJECTED
    return response


def is_inference(services: Services, request: ClientRequest) -> bool:
    """Whether the request is one the evidence records (an observed inference route)."""
    return services.settings.observe and is_observed(request.method, request.path)


def prepare(services: Services, exchange: Exchange, body: bytearray, path: str) -> PreparedRequest:
    """Read an observed body: stream, model, and the include_usage injection when it applies."""
    settings, info = services.settings, services.engine.info
    # Whether to inject is the engine's stream rule (llama.cpp: never), unless it refused.
    inject = (
        settings.inject_usage and rules_for(info).inject and not services.injection_refusals.refused(info)
    )
    prepared = prepare_request(body, inject_usage=inject, path=path)
    exchange.observed = True
    exchange.stream = prepared.stream
    exchange.model = prepared.model
    exchange.usage_injected = prepared.usage_injected
    exchange.engine_info = info
    return prepared


def record_finished(
    services: Services, request: ClientRequest, exchange: Exchange, *, stalled: bool, served_by: ServedBy
) -> None:
    """Count the request (by the server that took it) and, when it was observed and admitted,
    record its observation.

    Every request is counted, those the sidecar itself turned away (400, 413, 503) included, in
    one call with its observation; an inference request turned away before admission gets its
    record too (outcome "rejected").
    """
    finished_ns = time.time_ns()
    if stalled:
        exchange.outcome = Outcome.CLIENT_STALLED
    forwarded, recorder = exchange.forwarded(request, finished_ns, served_by), services.recorder
    if exchange.numbered is not None:  # observed and admitted
        recorder.finished(forwarded, exchange.observation(request, finished_ns))
    else:
        recorder.finished(forwarded, None)
        if exchange.outcome == Outcome.REJECTED and is_inference(services, request):
            recorder.rejected(exchange.observation(request, finished_ns))


async def admitted_exchange(
    side: ClientSide[R], exchange: Exchange, prepared: PreparedRequest | None, body: Body, limit: int
) -> R:
    """Pass the drain gate, take the reset ordinal, then exchange; the admission slot is held throughout.

    `prepared` is an observed body in hand; None: `body` is what goes upstream as it is.
    """
    services, request = side.services, side.request
    isolated = isolate(services, request, exchange, prepared)
    # `is not prepared` first: nearly every request is not isolated, and web.Response is an ABC
    # (a MutableMapping), whose isinstance check is a Python call.
    if isolated is not prepared and isinstance(isolated, web.Response):  # it must be isolated and cannot be
        return await side.respond(rejected(exchange, isolated))
    prepared = isolated
    admission = services.admission
    if not await admission.admit():
        return await side.respond(
            rejected(
                exchange,
                error_response(
                    503,
                    "the sidecar held this request while a cache reset drained the engine, and the wait ran out",
                    type_="service_unavailable",
                    code="draining",
                ),
            )
        )
    try:
        if exchange.observed:
            # Numbered after admission: a request held during a drain belongs to the new reset.
            recorder = services.recorder
            session_id = case_id = None
            if recorder.follows_cases:  # the KV events index records each case's start
                session_id, case_id = exchange.stored_ids(request.headers)
            exchange.numbered = recorder.begin_request(
                request.headers.get(CASE_HEADER), session_id=session_id, case_id=case_id
            )
        elif is_inference(services, request):
            # Streamed past the observation budget: no record, yet it reaches the engine.
            services.recorder.unobserved_request(request.headers.get(CASE_HEADER))
        return await _exchange(side, exchange, prepared, body, limit)
    finally:
        admission.leave()


def _upstream_failure(exc: BaseException, exchange: Exchange) -> web.Response:
    """Map an upstream failure before the response head to 502/504."""
    if isinstance(exc, TimeoutError):
        exchange.outcome = Outcome.TIMEOUT
        status, code, what = 504, "upstream_timeout", "the upstream did not answer in time"
    elif isinstance(exc, UpstreamBadResponse):
        exchange.outcome, exchange.bad_answer = Outcome.UPSTREAM_ERROR, True
        # The reason is the leg's own words (a limit, a rule), never a byte of the engine's.
        status, code, what = 502, "upstream_bad_answer", f"the upstream's answer cannot be relayed: {exc}"
    else:
        exchange.outcome = Outcome.UPSTREAM_ERROR
        status, code = 502, "upstream_unreachable"
        # An unreachable engine: the leg's words (the address and the OS error, no engine bytes).
        what = str(exc) if isinstance(exc, UpstreamUnreachable) else "the upstream broke the connection"
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


def _upstream_data(prepared: PreparedRequest, size: int) -> Body:
    """What goes upstream (`size` bytes): a small body as bytes, a large one as pieces of the client's
    buffer (written in slices, never copied whole). Both can be sent twice (a stale pooled connection)."""
    if size > _CHUNK:
        return prepared.upstream_pieces()
    return prepared.upstream_body()


async def _exchange(
    side: ClientSide[R],
    exchange: Exchange,
    prepared: PreparedRequest | None,
    body: Body,
    limit: int,
    *,
    refusal: str | None = None,
) -> R:
    """Send the request upstream and relay the response.

    An engine that refuses the injected include_usage gets the client's own body instead,
    once: `refusal` then says why the injected one could not stand.
    """
    services, request = side.services, side.request
    headers = request_headers(
        request.headers,
        request_id=exchange.request_id,
        usage_injected=exchange.usage_injected,
        add_request_id=services.settings.request_id_header,
    )
    data: Body = body
    if prepared is not None:
        size = prepared.upstream_size
        data = _upstream_data(prepared, size)
        # The body may carry the injection: its length is ours to say.
        headers["Content-Length"] = str(size)
    exchange.upstream_sent_ns = time.time_ns()
    try:
        upstream = await services.leg.send(request.method, request.raw_path, headers, data)
    except BodyTooLarge:
        return await side.respond(rejected(exchange, too_large(limit)))
    except ClientGone:
        exchange.outcome = Outcome.CLIENT_DISCONNECTED
        raise asyncio.CancelledError from None
    except asyncio.CancelledError:
        exchange.outcome = Outcome.CLIENT_DISCONNECTED
        raise
    except UpstreamError as exc:
        return await side.respond(_upstream_failure(exc, exchange))
    exchange.upstream_head_ns = time.time_ns()
    # The request's last byte written to the engine, counted from the client's last byte read
    # (or, for a body streamed as it came, from its last piece in hand). A body still being
    # written when the answer began has no last byte yet: not measured.
    if upstream.sent_ns:
        exchange.added_in_us = elapsed_us(upstream.streamed_in_ns or exchange.read_ns, upstream.sent_ns)
    try:
        peeked = b""
        if refusal is not None:
            _judge_refusal(side, exchange, upstream.status, refusal)
        elif exchange.usage_injected and prepared is not None:
            refused, peeked = await _injection_refusal(upstream)
            if refused is not None:
                # The client must not fail, nor get other bytes, because of us: it gets the
                # engine's answer to its own request, sent once more as the client wrote it.
                upstream.close()
                exchange.usage_injected = False
                return await _exchange(
                    side, exchange, prepared.without_injection(), None, limit, refusal=refused
                )
        await relay(side, upstream, exchange, peeked)
        return side.relayed()
    finally:
        # An answer not read to its end closes its connection: it must not go back to the pool
        # half-read, and closing it is what tells the engine to abort the sequence
        # (production-stack #634). A complete answer's connection is already back in the pool.
        upstream.close()


def _judge_refusal(side: ClientSide[R], exchange: Exchange, status: int, refusal: str) -> None:
    """Probe the engine when the client's own request, without the injection, succeeded.

    A client's bad request whose error merely quotes `stream_options` (`"messages":
    "stream_options"`) fails both ways: no probe. One that succeeds without the injection is
    still no proof: the engine may read its body otherwise than the sidecar (an escaped or
    repeated name, issue 45). Only the sidecar's own probe switches the injection off.
    """
    if not 200 <= status < 300:
        return
    log_event(
        log,
        logging.INFO,
        f"engine {refusal}, and took the client's own request without it; probing the engine",
        request_id=exchange.request_id,
        status=status,
    )
    services = side.services
    services.injection_probe.suspect(services.app, exchange.engine_info, side.request.path, exchange.model)


async def _injection_refusal(upstream: UpstreamResponse) -> tuple[str | None, bytes]:
    """Why the answer to an injected request cannot stand (None if it can), and what was read of it.

    An error naming `stream_options` refuses the injection; a compressed answer (the engine
    ignored `Accept-Encoding: identity`) cannot be scanned, so the injection could not be
    taken out again. Only an error's body is read here, at most 64 KiB; the caller relays it.
    """
    if upstream.headers.get("Content-Encoding", "identity").lower() != "identity":
        return "compressed an injected answer", b""
    if upstream.status not in REFUSED_STATUSES:
        return None, b""
    peeked = await upstream.peek(_ERROR_PEEK)
    return ("refused the injected include_usage" if names_stream_options(peeked) else None), peeked
