"""The one keep-alive pool toward the engine, its lifetime, and sending again when a reused connection was stale.

uvicorn (vLLM, SGLang) closes a connection after 5 s idle. A request written onto a
pooled connection just as the engine closes it fails with no answer, and aiohttp
retries only idempotent methods, never the POSTs that inference and resets are. Two
defences: the pool drops connections idle past `upstream_keepalive_timeout` (default
4 s, below the engine's), and `send_upstream` sends a request once more when a reused
connection failed before any response arrived, which covers the race that remains.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web

from proxy.config import SETTINGS, Settings
from proxy.logs import log_event

__all__ = ["UPSTREAM_POOL", "make_client_session", "send_upstream", "setup_upstream_pool"]

UPSTREAM_POOL = web.AppKey("upstream_pool", aiohttp.ClientSession)

log = logging.getLogger("cachewitness.pool")

# A failed stale connection is closed, not pooled again; a pool of many connections all
# closed at once by the engine could hand out several in a row, so a few are tolerated.
_MOST_STALE_IN_A_ROW = 8


@dataclass
class _Reuse:
    """Per request: whether the pool handed it a connection that had served before."""

    reused: bool = False


async def _on_reuse(
    _session: aiohttp.ClientSession, context: SimpleNamespace, _params: aiohttp.TraceConnectionReuseconnParams
) -> None:
    """aiohttp's trace hook: the request at hand got a pooled connection."""
    if isinstance(context.trace_request_ctx, _Reuse):
        context.trace_request_ctx.reused = True


def _reuse_trace() -> aiohttp.TraceConfig:
    """The trace that tells `send_upstream` whether a connection was reused."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_on_reuse)
    return trace


def make_client_session(settings: Settings) -> aiohttp.ClientSession:
    """The one keep-alive pool toward the upstream, transparent by construction."""
    connector = aiohttp.TCPConnector(
        # aiohttp's default limit of 100 would queue the 101st stream inside the sidecar.
        limit=settings.upstream_connection_limit,
        limit_per_host=0,
        ttl_dns_cache=300,
        enable_cleanup_closed=False,
        force_close=False,
        # Below the engine's own idle timeout, so the pool drops a connection before the engine does.
        keepalive_timeout=settings.upstream_keepalive_timeout,
    )
    timeout = aiohttp.ClientTimeout(
        total=None,  # streams may last as long as the engine generates
        sock_connect=settings.connect_timeout or None,
        sock_read=settings.read_timeout or None,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,  # content-encoding passes through untouched
        trust_env=False,  # no environment proxy between the sidecar and its engine
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
        raise_for_status=False,
        trace_configs=[_reuse_trace()],
    )


def setup_upstream_pool(app: web.Application) -> None:
    """Open the pool at start, close it after everything that uses it has stopped.

    It lives in cleanup_ctx (not on_shutdown) so streams still draining at shutdown keep
    their upstream connection (SPEC §11).
    """

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        session = make_client_session(app[SETTINGS])
        app[UPSTREAM_POOL] = session
        yield
        await session.close()

    app.cleanup_ctx.append(lifetime)


def _stale(exc: BaseException, reuse: _Reuse) -> bool:
    """A reused connection that broke before the answer began: the engine had closed it."""
    if isinstance(exc, aiohttp.ClientConnectorError) or not reuse.reused:
        return False  # a fresh connection that fails says something about the engine: no retry
    return isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))


async def send_upstream(
    session: aiohttp.ClientSession, method: str, url: Any, *, data: Any = None, **options: Any
) -> aiohttp.ClientResponse:
    """`session.request`, sent again when a reused connection turned out stale.

    Only a body that can be sent twice (bytes, or none) is sent again; a streamed body
    has been consumed by the first try. Each stale connection is closed as it fails, so
    the tries run through the pool's stale connections to a fresh one, which is the last.
    """
    replayable = data is None or isinstance(data, bytes)
    for stale_so_far in range(_MOST_STALE_IN_A_ROW + 1):
        reuse = _Reuse()
        try:
            return await session.request(method, url, data=data, trace_request_ctx=reuse, **options)
        except (aiohttp.ClientError, OSError) as exc:
            if not (replayable and _stale(exc, reuse)) or stale_so_far == _MOST_STALE_IN_A_ROW:
                raise
            log_event(log, logging.INFO, "stale upstream connection; sending again", error=type(exc).__name__)
    raise AssertionError("unreachable: the last try returns or raises")
