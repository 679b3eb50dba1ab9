"""The client's request body on its way in: streamed within max_body_bytes, or read within the body budget."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from proxy.body_budget import BodyBudget
from proxy.forward_exchange import Exchange

__all__ = ["BodyTooLarge", "ClientGone", "limited_body", "read_within_budget"]


class BodyTooLarge(Exception):
    """The client's request body passed `max_body_bytes`."""


class ClientGone(Exception):
    """The client went away while its body was being read."""


async def limited_body(request: web.Request, limit: int, prefix: bytes = b"") -> AsyncIterator[bytes]:
    """Stream the client's body upstream, stopping once it passes `limit` bytes.

    `prefix`: what was read of it already (the start of a body that did not fit the budget).
    """
    seen = len(prefix)
    if prefix:
        yield prefix
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


async def read_within_budget(
    request: web.Request, limit: int, budget: BodyBudget, exchange: Exchange
) -> tuple[bytearray, bool]:
    """The request body read into one buffer within the budget, and whether it is all there.

    A body of known length is read only if all of it fits (else nothing is read). One of
    unknown length (chunked) takes the budget as it arrives; when the budget runs out, what
    was read is returned incomplete, to be sent ahead of the rest. `exchange.buffered` says
    what this exchange holds of the budget, for its caller to give back.
    """
    body = bytearray()
    size = request.content_length
    if size is not None:
        if not budget.reserve(size):
            return body, False
        exchange.buffered = size
        async for chunk in limited_body(request, limit):
            body += chunk
        return body, True
    async for chunk in limited_body(request, limit):
        body += chunk
        if not budget.reserve(len(chunk)):
            return body, False
        exchange.buffered += len(chunk)
    return body, True
