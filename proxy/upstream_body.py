"""An observed request body on its way upstream: the client's buffer, the injection spliced in."""

from __future__ import annotations

from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload

__all__ = ["SplicedBody"]

_SLICE = 64 * 1024


class SplicedBody(Payload):
    """Pieces of one buffer (and the few injected bytes) written in 64 KiB slices.

    Written as one 60 MiB `bytes`, a body would be copied into the socket's buffer; in
    slices, aiohttp drains between them. Nothing is consumed by a write, so a request on a
    stale pooled connection can be sent again (proxy.pool.send_upstream).
    """

    _autoclose = True  # memory only: nothing to close

    def __init__(self, pieces: tuple[bytes | bytearray | memoryview, ...]) -> None:
        """Send `pieces` in order (headers are the request's own: the pool adds no Content-Type)."""
        super().__init__(pieces)
        self._pieces = pieces
        self._total = sum(memoryview(piece).nbytes for piece in pieces)
        self._size = self._total

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        """The body as text (aiohttp's debugging hook; never called on the forwarding path)."""
        return b"".join(self._pieces).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        """Write every piece, slice by slice."""
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
        """Write up to `content_length` bytes (all when None), slice by slice."""
        left = self._total if content_length is None else min(content_length, self._total)
        for piece in self._pieces:
            view = memoryview(piece)
            for offset in range(0, len(view), _SLICE):
                if left <= 0:
                    return
                chunk = view[offset : offset + min(_SLICE, left)]
                await writer.write(chunk)
                left -= len(chunk)
