"""The client's side of one forwarded exchange, whichever server took the request.

Two servers take client requests: aiohttp (every route) and the front (proxy/front/: plain
inference requests, without aiohttp's per-request machinery). What the exchange with the
engine needs of either: the request (`ClientRequest`) and where the answer goes.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from aiohttp import web

from proxy.forward.exchange import ClientRequest, Exchange
from proxy.upstream import UpstreamResponse

__all__ = ["Side"]

R_co = TypeVar("R_co", covariant=True)


class Side(Protocol[R_co]):
    """Where an exchange's answer goes; R_co is what the server's handler returns for it."""

    @property
    def request(self) -> ClientRequest: ...

    @property
    def app(self) -> web.Application: ...

    async def answer(self, response: web.Response) -> R_co:
        """The sidecar's own answer (an error the exchange ends with)."""
        ...

    async def relay(self, upstream: UpstreamResponse, exchange: Exchange, peeked: bytes) -> R_co:
        """The engine's answer, streamed to the client as it arrives (`peeked`: its start, read already)."""
        ...
