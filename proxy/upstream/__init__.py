"""Forward's leg to the engine: a keep-alive pool on asyncio protocols, responses parsed by httptools.

`UpstreamLeg.send` writes a request and returns its `UpstreamResponse`; failures are `UpstreamError`s
(`UpstreamUnreachable`, `UpstreamTimeout`, `UpstreamBroke`, `UpstreamBadResponse`) that forward
maps to 502/504.
"""

from proxy.upstream.errors import (
    UpstreamBadResponse,
    UpstreamBroke,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from proxy.upstream.head import Body, Pieces
from proxy.upstream.leg import UpstreamLeg
from proxy.upstream.response import UpstreamResponse

__all__ = [
    "Body",
    "Pieces",
    "UpstreamBadResponse",
    "UpstreamBroke",
    "UpstreamError",
    "UpstreamLeg",
    "UpstreamResponse",
    "UpstreamTimeout",
    "UpstreamUnreachable",
]
