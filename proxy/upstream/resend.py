"""Sending a request again when a reused pooled connection turned out stale.

A request written onto a pooled connection just as the engine closes it fails with no
response, and aiohttp retries only idempotent methods, never the POSTs that inference and
resets are. `send_upstream` sends such a request once more on the next connection. It
knows nothing of the app: the engine dialects (leaves) use it for their own calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp

from proxy.logs import log_event

__all__ = ["MOST_STALE_IN_A_ROW", "reuse_trace", "send_upstream"]

log = logging.getLogger("cachewitness.pool")

# A failed stale connection is closed, not pooled again; a pool of many connections all
# closed at once by the engine could hand out several in a row, so a few are tolerated.
MOST_STALE_IN_A_ROW = 8


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


def reuse_trace() -> aiohttp.TraceConfig:
    """The trace that tells `send_upstream` whether a connection was reused."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_on_reuse)
    return trace


def _stale(exc: BaseException, reuse: _Reuse) -> bool:
    """A reused connection that broke before the response began: the engine had closed it."""
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
    for stale_so_far in range(MOST_STALE_IN_A_ROW + 1):
        reuse = _Reuse()
        try:
            return await session.request(method, url, data=data, trace_request_ctx=reuse, **options)
        except (aiohttp.ClientError, OSError) as exc:
            if not (replayable and _stale(exc, reuse)) or stale_so_far == MOST_STALE_IN_A_ROW:
                raise
            log_event(log, logging.INFO, "stale upstream connection; sending again", error=type(exc).__name__)
    raise AssertionError("unreachable: the last try returns or raises")
