"""Forward's leg to the engine: a keep-alive pool on asyncio protocols, answers parsed by httptools.

`UpstreamLeg.send` writes a request and returns its `Answer`; failures are `UpstreamError`s
(`UpstreamUnreachable`, `UpstreamTimeout`, `UpstreamBroke`, `UpstreamBadAnswer`) that forward
maps to 502/504.
"""

from proxy.upstream.answer import Answer
from proxy.upstream.errors import (
    UpstreamBadAnswer,
    UpstreamBroke,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from proxy.upstream.head import Body, Pieces
from proxy.upstream.leg import UpstreamLeg

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
