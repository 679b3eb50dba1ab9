"""The client's request body on its way in: streamed within max_body_bytes, or read within the body budget."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web

from proxy.body_budget import BodyBudget
from proxy.forward.client import BodyTooLarge, ClientGone
from proxy.forward.exchange import Exchange

__all__ = ["BodyStart", "limited_body", "read_within_budget"]


class BodyStart:
    """The start of a body that did not fit the budget, handed to the stream that sends it, once.

    Whoever built it keeps no reference to the bytes: once sent they are freed, while the
    rest of the body may take as long as the client needs.
    """

    __slots__ = ("_data",)

    def __init__(self, data: bytearray) -> None:
        self._data: bytearray | None = data

    def take(self) -> bytearray:
        """The bytes (empty after the first call)."""
        data, self._data = self._data, None
        return data if data is not None else bytearray()


async def limited_body(
    request: web.Request,
    limit: int,
    start: BodyStart | None = None,
    start_sent: Callable[[], None] | None = None,
) -> AsyncIterator[bytes | bytearray]:
    """Stream the client's body upstream, stopping once it passes `limit` bytes.

    `start`: what was read of it already; `start_sent` is called once the upstream took it.
    """
    seen = 0
    if start is not None and (data := start.take()):
        seen = len(data)
        # Not copied to bytes: the upstream transport only writes it, and this was its last reference.
        yield data
        del data
        if start_sent is not None:
            start_sent()
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

    The budget is taken as the bytes arrive (proxy/body_budget.py says why). A body of known
    length that could not fit in what is free now is not read at all. When the budget runs
    out part-way, what was read is returned incomplete, to be sent ahead of the rest.
    `exchange.buffered` is what this exchange holds of the budget, for its caller to give back.
    """
    body = bytearray()
    size = request.content_length
    if size is not None and not budget.fits(size):
        return body, False
    reading = exchange.buffered = budget.start_reading()
    complete = False
    try:
        async for chunk in limited_body(request, limit):
            body += chunk
            if not await budget.take(reading, len(chunk)):
                return body, False
        complete = True
        return body, True
    finally:
        budget.done_reading(reading, complete=complete)
