"""The client's side of one forwarded exchange: what forward/ needs of whichever server took the request.

Two servers take client requests (proxy/inbound/: the front, and aiohttp); forward/ knows
neither. Each hands the exchange a `ClientSide`: the request, where the sidecar's own response
goes, and the client wire the engine's response is relayed onto — its head with the bytes in
hand, then the body as it arrives (straight onto the transport), then its end.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, TypeVar

from aiohttp import web
from multidict import CIMultiDict

from proxy.forward.exchange import ClientRequest
from proxy.forward.services import Services
from proxy.vocabulary import ServedBy

__all__ = ["BodyTooLarge", "ClientGone", "ClientSide"]

R_co = TypeVar("R_co", covariant=True)


class BodyTooLarge(Exception):
    """The client's request body passed `max_body_bytes` (raised while it streams upstream)."""


class ClientGone(Exception):
    """The client went away while its body was being read."""


class ClientSide(Protocol[R_co]):
    """Where an exchange's response goes; R_co is what the server's handler returns for it."""

    @property
    def request(self) -> ClientRequest: ...

    @property
    def services(self) -> Services: ...

    @property
    def served_by(self) -> ServedBy: ...

    async def respond(self, response: web.Response) -> R_co:
        """The sidecar's own response (an error the exchange ends with)."""
        ...

    def response_headers(self, status: int, reason: str) -> CIMultiDict[str]:
        """The engine's response begins: the headers the client gets, for the relay to fill."""
        ...

    async def send_head(self, first: bytes) -> tuple[asyncio.Transport, bool]:
        """The head and `first` (the body in hand, maybe none) in one write; the transport the
        body goes on and whether it is chunked. ConnectionResetError: the client is gone."""
        ...

    async def drain(self) -> None:
        """Return once a client that is behind took what is buffered; raise if it is gone."""
        ...

    async def end(self, tail: bytes) -> None:
        """The body's last bytes (maybe none) and its end."""
        ...

    def cut(self) -> None:
        """Cut the client's connection: a body cut short must never pass for a whole one."""
        ...

    def relayed(self) -> R_co:
        """What the server's handler returns once the engine's response was relayed."""
        ...
