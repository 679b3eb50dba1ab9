"""The streaming reverse proxy handler: everything the sidecar does not own goes upstream."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiohttp import web

from proxy.admission import ADMISSION
from proxy.body_budget import BODY_BUDGET, BodyBudget
from proxy.config import SETTINGS
from proxy.connections import CLIENT_STALLED
from proxy.engine_state import ENGINE
from proxy.errors import error_response
from proxy.forward.exchange import Exchange
from proxy.forward.headers import CASE_HEADER, request_headers
from proxy.forward.ids import SESSION_ID_CHARS, new_request_id, stored_id
from proxy.forward.inbound import refusal
from proxy.forward.relay import relay
from proxy.forward.request_body import BodyStart, BodyTooLarge, ClientGone, limited_body, read_within_budget
from proxy.logs import log_event
from proxy.observe import (
    InjectionRefusals,
    PreparedRequest,
    is_observed,
    names_stream_options,
    prepare_request,
    rules_for,
)
from proxy.recorder import RECORDER
from proxy.upstream import Body, UpstreamBadResponse, UpstreamError, UpstreamResponse, UpstreamUnreachable
from proxy.upstream.pools import UPSTREAM_LEG
from proxy.vocabulary import Outcome
from proxy.witnesses.events_index import CACHE_INDEX

__all__ = ["INJECTION_REFUSALS", "forward", "setup_forward"]

log = logging.getLogger("cachewitness.forward")

# Validation failures (FastAPI's 422, plain 400) that may be our injected stream_options;
# only one whose body names `stream_options` is (a "context too long" 400 is the client's).
_REFUSED_INJECTION = frozenset({400, 422})
_ERROR_PEEK = 64 * 1024
# An observed body past this goes upstream in pieces of the client's buffer, not one copy.
_CHUNK = 64 * 1024
# Engines that refused the injection, remembered for a while so each costs one retried request.
INJECTION_REFUSALS = web.AppKey("injection_refusals", InjectionRefusals)


def setup_forward(app: web.Application) -> None:
    """What forwarding keeps across requests: the engines that refused the injection."""
    app[INJECTION_REFUSALS] = InjectionRefusals(app[SETTINGS].inject_usage_reprobe_seconds)


def _too_large(limit: int) -> web.Response:
    return error_response(
        413,
        f"request body is larger than max_body_bytes ({limit} bytes)",
        type_="invalid_request_error",
        code="request_too_large",
    )


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


def _upstream_data(prepared: PreparedRequest) -> Body:
    """What goes upstream: a small body as bytes, a large one as pieces of the client's buffer
    (written in slices, never copied whole). Both can be sent twice (a stale pooled connection)."""
    if prepared.upstream_size > _CHUNK:
        return prepared.upstream_pieces()
    return prepared.upstream_body()


async def forward(request: web.Request) -> web.StreamResponse:
    """Proxy one request to the upstream and stream the answer back."""
    app = request.app
    # The client's id when it sent one; else 32 random hex digits, as uuid4().hex gave but
    # without building a UUID (issue 19) nor a system call per request (issue 34).
    request_id = stored_id(request.headers.get("X-Request-Id")) or new_request_id()
    exchange = Exchange(request_id=request_id, started_ns=time.time_ns())
    try:
        refused = refusal(request)
        if refused is not None:
            log_event(
                log,
                logging.WARNING,
                f"request refused: {refused.code}",
                request_id=exchange.request_id,
                header=refused.header,
            )
            return _rejected(exchange, refused.response())
        return await _admit_and_exchange(request, exchange)
    finally:
        # Every request is counted, those the sidecar itself turned away (400, 413, 503) included,
        # in one call with its observation when it was observed and admitted; an inference
        # request turned away before that gets its record too (outcome "rejected").
        finished_ns = time.time_ns()
        if request.get(CLIENT_STALLED, False):
            exchange.outcome = Outcome.CLIENT_STALLED
        forwarded, recorder = exchange.forwarded(request, finished_ns), app[RECORDER]
        if exchange.observed and exchange.admitted:
            recorder.finished(forwarded, exchange.observation(request, finished_ns))
        else:
            recorder.finished(forwarded, None)
            if exchange.outcome == Outcome.REJECTED and _is_inference(request):
                recorder.rejected(exchange.observation(request, finished_ns))


def _is_inference(request: web.Request) -> bool:
    """Whether the request is one the evidence records (an observed inference route)."""
    return request.app[SETTINGS].observe and is_observed(request.method, request.path)


def _rejected(exchange: Exchange, response: web.Response) -> web.Response:
    """A request the sidecar answers itself, without the engine."""
    exchange.status = response.status
    exchange.outcome = Outcome.REJECTED
    return response


async def _admit_and_exchange(request: web.Request, exchange: Exchange) -> web.StreamResponse:
    """Refuse a body past max_body_bytes; the budget taken while reading it is given back at the end."""
    app = request.app
    limit = app[SETTINGS].max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        return _rejected(exchange, _too_large(limit))
    budget = app[BODY_BUDGET]
    try:
        return await _observe_and_exchange(request, exchange, budget)
    finally:
        if exchange.buffered is not None:
            budget.give_back(exchange.buffered)


async def _observe_and_exchange(
    request: web.Request, exchange: Exchange, budget: BodyBudget
) -> web.StreamResponse:
    """Read an inference request's body within the budget, then admit and exchange."""
    app = request.app
    settings = app[SETTINGS]
    limit = settings.max_body_bytes
    prepared: PreparedRequest | None = None
    start: BodyStart | None = None
    if settings.observe and is_observed(request.method, request.path):
        try:
            body, complete = await read_within_budget(request, limit, budget, exchange)
        except BodyTooLarge:
            return _rejected(exchange, _too_large(limit))
        except ClientGone:
            exchange.outcome = Outcome.CLIENT_DISCONNECTED
            raise asyncio.CancelledError from None
        if complete:
            prepared = _prepare(app, exchange, body, request.path)
        else:
            start = BodyStart(body)
            budget.passed_unobserved(exchange.request_id, request.content_length)
        del body  # the start of a body that did not fit is freed once sent (BodyStart)
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
            exchange.admitted = True
            # Assigned after admission: a request held during a drain belongs to the new reset.
            begun = app[RECORDER].begin_request(request.headers.get(CASE_HEADER))
            exchange.reset_id, exchange.ordinal, exchange.case_token_carried = begun
            index = app.get(CACHE_INDEX)
            if index is not None:  # a case's first request: what the engine's cache holds as it starts
                headers = request.headers
                index.request_started(
                    stored_id(headers.get("X-Session-Id"), SESSION_ID_CHARS),
                    stored_id(headers.get("X-Case-Id"), SESSION_ID_CHARS),
                )
        elif _is_inference(request):
            # Streamed past the observation budget: no record, yet it reaches the engine.
            app[RECORDER].unobserved_request(request.headers.get(CASE_HEADER))
        return await _exchange(request, exchange, prepared, limit, start=start)
    finally:
        admission.leave()


def _give_back(request: web.Request, exchange: Exchange) -> Callable[[], None]:
    """Give back the budget a body that did not fit took, once the engine has its start (the rest streams)."""

    def give_back() -> None:
        if exchange.buffered is not None:
            request.app[BODY_BUDGET].give_back(exchange.buffered)

    return give_back


def _prepare(app: web.Application, exchange: Exchange, body: bytearray, path: str) -> PreparedRequest:
    """Read an observed body: stream, model, and the include_usage injection when it applies."""
    settings, info = app[SETTINGS], app[ENGINE].info
    # Whether to inject is the engine's stream rule (llama.cpp: never), unless it refused.
    inject = settings.inject_usage and rules_for(info).inject and not app[INJECTION_REFUSALS].refused(info)
    prepared = prepare_request(body, inject_usage=inject, path=path)
    exchange.observed = True
    exchange.stream = prepared.stream
    exchange.model = prepared.model
    exchange.usage_injected = prepared.usage_injected
    exchange.engine_info = info
    return prepared


async def _exchange(
    request: web.Request,
    exchange: Exchange,
    prepared: PreparedRequest | None,
    limit: int,
    *,
    start: BodyStart | None = None,
    refusal: str | None = None,
) -> web.StreamResponse:
    """Send the request upstream and relay the answer; the admission slot is held throughout.

    `prepared` is an observed body in hand (None: the body streams through, after `start`).
    An engine that refuses the injected include_usage gets the client's own body instead,
    once: `refusal` then says why the injected one could not stand.
    """
    leg = request.app[UPSTREAM_LEG]
    headers = request_headers(
        request,
        request_id=exchange.request_id,
        usage_injected=exchange.usage_injected,
        add_request_id=request.app[SETTINGS].request_id_header,
    )
    data: Body
    if prepared is not None:
        data = _upstream_data(prepared)
        # The body may carry the injection: its length is ours to say.
        headers["Content-Length"] = str(prepared.upstream_size)
    else:
        data = (
            limited_body(request, limit, start, _give_back(request, exchange))
            if request.body_exists
            else None
        )
    exchange.upstream_sent_ns = time.time_ns()
    try:
        upstream = await leg.send(request.method, request.raw_path, headers, data)
    except BodyTooLarge:
        return _rejected(exchange, _too_large(limit))
    except ClientGone:
        exchange.outcome = Outcome.CLIENT_DISCONNECTED
        raise asyncio.CancelledError from None
    except asyncio.CancelledError:
        exchange.outcome = Outcome.CLIENT_DISCONNECTED
        raise
    except UpstreamError as exc:
        return _upstream_failure(exc, exchange)
    exchange.upstream_head_ns = time.time_ns()
    try:
        peeked = b""
        if refusal is not None:
            _judge_refusal(request.app, exchange, upstream.status, refusal)
        elif exchange.usage_injected and prepared is not None:
            refused, peeked = await _injection_refusal(upstream)
            if refused is not None:
                # The client must not fail, nor get other bytes, because of us: it gets the
                # engine's answer to its own request, sent once more as the client wrote it.
                upstream.close()
                exchange.usage_injected = False
                return await _exchange(
                    request, exchange, prepared.without_injection(), limit, refusal=refused
                )
        return await relay(request, upstream, exchange, peeked)
    finally:
        # An answer not read to its end closes its connection: it must not go back to the pool
        # half-read, and closing it is what tells the engine to abort the sequence
        # (production-stack #634). A complete answer's connection is already back in the pool.
        upstream.close()


def _judge_refusal(app: web.Application, exchange: Exchange, status: int, refusal: str) -> None:
    """Remember a refusal only when the client's own request, without the injection, succeeded.

    Only then can the error have come from the injection: a client's bad request whose
    error merely quotes `stream_options` (`"messages": "stream_options"`) fails both ways,
    and must not switch the injection off for everyone else.
    """
    if not 200 <= status < 300:
        return
    refusals = app[INJECTION_REFUSALS]
    refusals.remember(exchange.engine_info)
    log_event(
        log,
        logging.INFO,
        f"engine {refusal}, and took the client's own request without it; "
        f"not injecting for this engine for {refusals.reprobe_s:g} s",
        request_id=exchange.request_id,
        status=status,
    )


async def _injection_refusal(upstream: UpstreamResponse) -> tuple[str | None, bytes]:
    """Why the answer to an injected request cannot stand (None if it can), and what was read of it.

    An error naming `stream_options` refuses the injection; a compressed answer (the engine
    ignored `Accept-Encoding: identity`) cannot be scanned, so the injection could not be
    taken out again. Only an error's body is read here, at most 64 KiB; the caller relays it.
    """
    if upstream.headers.get("Content-Encoding", "identity").lower() != "identity":
        return "compressed an injected answer", b""
    if upstream.status not in _REFUSED_INJECTION:
        return None, b""
    peeked = await upstream.peek(_ERROR_PEEK)
    return ("refused the injected include_usage" if names_stream_options(peeked) else None), peeked
