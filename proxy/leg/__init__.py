"""Forward's leg to the engine: a keep-alive pool on asyncio protocols, answers parsed by httptools.

`UpstreamLeg.send` writes a request and returns its `Answer`; failures are `UpstreamError`s
(`UpstreamUnreachable`, `UpstreamTimeout`, `UpstreamBroke`, `UpstreamBadAnswer`) that forward
maps to 502/504.
"""

from proxy.leg.answer import Answer
from proxy.leg.errors import (
    UpstreamBadAnswer,
    UpstreamBroke,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from proxy.leg.head import Body, Pieces
from proxy.leg.pool import UpstreamLeg

__all__ = [
    "Answer",
    "Body",
    "Pieces",
    "UpstreamBadAnswer",
    "UpstreamBroke",
    "UpstreamError",
    "UpstreamLeg",
    "UpstreamTimeout",
    "UpstreamUnreachable",
]
