"""One keep-alive connection to the engine: asyncio protocol, answers parsed by httptools (llhttp).

Why not aiohttp's ClientSession: on this path it cost 75 µs of CPU per small request against
23 µs for a bare protocol (bench/client_leg.py, issue 19); the sidecar's own calls (reset,
detection, canary, metrics) still use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httptools
from multidict import CIMultiDict

from proxy.leg.answer import Answer
from proxy.leg.errors import UpstreamBroke, UpstreamError, UpstreamTimeout
from proxy.leg.head import Body, framed

if TYPE_CHECKING:
    from proxy.leg.pool import UpstreamLeg

__all__ = ["Connection"]

# Pieces of a large body are written 64 KiB at a time, draining between them.
_SLICE = 64 * 1024


def _text(raw: bytes) -> str:
    # The decoding aiohttp's parser uses: bytes that are not UTF-8 survive the round trip.
    return raw.decode("utf-8", "surrogateescape")


class Connection(asyncio.Protocol):
    """A connection carries one answer at a time; between answers it waits in the pool.

    State is explicit: `_answer` is the answer being read (None while idle), `lost` says the
    transport is gone. Every parser callback runs inside `data_received`.
    """

    def __init__(self, pool: UpstreamLeg) -> None:
        self._pool = pool
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._answer: Answer | None = None
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._reason = b""
        self._keep_alive = False
        self._until_close = False  # a body with neither length nor chunks ends when the connection does
        self._informational = False  # a 1xx answer: the real one follows on the same connection
        self._head_only = False  # the request was HEAD: no body follows the head
        self._drain: asyncio.Future[None] | None = None
        self._write_paused = False
        self._read_paused = False
        self._last_read = 0.0  # when the engine last sent a byte (read_timeout counts from it)
        self.served = 0  # answers completed on a kept connection: > 0 means it is a reused one
        self.idle_since = 0.0
        self.lost = False

    # --- asyncio protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        answer = self._answer
        if answer is None:
            # Bytes nobody asked for: this connection cannot carry another answer.
            self.close()
            return
        answer.got_bytes = True
        self._last_read = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBroke(f"the engine's answer is not valid HTTP ({exc})", before_answer=False))
            return
        answer = self._answer  # None if the answer ended in this read (it relayed its end itself)
        if answer is not None and answer.flush():
            self._pause_reading()

    def eof_received(self) -> bool:
        return False  # close our side too: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(UpstreamBroke("the engine closed the connection", before_answer=False))
        answer, self._answer = self._answer, None
        if answer is not None:
            if self._until_close and answer.status:
                answer.complete()
            else:
                what = "reset" if exc is not None else "closed"
                answer.fail(
                    UpstreamBroke(
                        f"the engine {what} the connection before the answer ended",
                        before_answer=not answer.got_bytes,
                    )
                )
        self._pool.forget(self)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # --- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._raw_headers = []
        self._reason = b""

    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        answer = self._answer
        assert answer is not None  # data_received feeds the parser only while an answer waits
        status = self._parser.get_status_code()
        if status < 200:
            self._informational = True  # 100 Continue, 103 Early Hints: not the answer
            return
        headers: CIMultiDict[str] = CIMultiDict((_text(n), _text(v)) for n, v in self._raw_headers)
        self._keep_alive = self._parser.should_keep_alive()
        self._until_close = (
            "Content-Length" not in headers
            and "Transfer-Encoding" not in headers
            and status not in (204, 304)
            and not self._head_only
        )
        answer.head_ready(status, _text(self._reason), headers)
        if self._head_only:
            # llhttp cannot be told that a HEAD answer has no body: the answer ends here,
            # and the connection with it.
            self._answer = None
            answer.complete()
            self.close()

    def on_body(self, body: bytes) -> None:
        answer = self._answer
        if answer is not None and answer.body(body):
            self._pause_reading()

    def _pause_reading(self) -> None:
        """The consumer (a slow client) is behind: stop reading from the engine."""
        if not self._read_paused:
            self._read_paused = True
            if self._transport is not None:
                self._transport.pause_reading()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        answer, self._answer = self._answer, None
        if answer is None:
            return
        self.served += 1
        answer.complete()
        writing = answer.writer is not None and not answer.writer.done()
        if self._keep_alive and not writing:
            if self._read_paused:
                # The buffer that was full is the answer's, now the consumer's alone.
                self._read_paused = False
                if self._transport is not None:
                    self._transport.resume_reading()
            self._pool.release(self)
        else:
            self.close()  # the engine asked to close, or our request body was not all sent

    # --- used by the pool and the answer ---------------------------------------------------

    async def exchange(self, head: bytes, body: Body, *, chunked: bool, head_only: bool) -> Answer:
        """Write one request and wait for its answer's head."""
        if self.lost or self._transport is None:
            raise UpstreamBroke("the pooled connection was closed", before_answer=True)
        answer = Answer(self, self._loop.create_future())
        self._answer, self._head_only, self._until_close = answer, head_only, False
        self._last_read = self._loop.time()
        self._pool.watch(self)
        transport = self._transport
        if body is None:
            transport.write(head)
        elif isinstance(body, bytes):
            transport.write(head + body)  # one write: one packet for a small request
        else:
            transport.write(head)
            answer.writer = self._loop.create_task(self._write_body(body, chunked))
            answer.writer.add_done_callback(self._body_written)
        try:
            if answer.writer is None:
                await answer.head_arrived
            else:
                await self._head_or_failed_body(answer, answer.writer)
        except BaseException:
            answer.close()
            raise
        return answer

    async def _head_or_failed_body(self, answer: Answer, writer: asyncio.Task[None]) -> None:
        """The head, unless writing the body failed first (the client's body too large, or gone)."""
        head = answer.head_arrived
        await asyncio.wait((head, writer), return_when=asyncio.FIRST_COMPLETED)
        if writer.done() and not writer.cancelled():
            error = writer.exception()
            if error is not None and not isinstance(error, UpstreamError):
                # The client's body stopped it (too large, or the client left): that is the
                # cause, though closing the connection for it may have failed the answer by now.
                raise error
        # A body the engine stopped reading (it closed): its answer, or the connection's own error.
        await head

    async def _write_body(self, body: Body, chunked: bool) -> None:
        """Write a body that is not one buffer: pieces in slices, or the client's stream as it comes."""
        transport = self._transport
        assert transport is not None
        if isinstance(body, tuple):
            for piece in body:
                view = memoryview(piece)
                for offset in range(0, len(view), _SLICE):
                    transport.write(view[offset : offset + _SLICE])
                    await self._drained()
            return
        assert isinstance(body, AsyncIterator)
        async for chunk in body:
            if not chunk:
                continue  # an empty chunk would end a chunked body
            transport.write(framed(chunk, chunked=chunked))
            await self._drained()
        if chunked:
            transport.write(b"0\r\n\r\n")

    def _body_written(self, writer: asyncio.Task[None]) -> None:
        """A body that failed half-way leaves the engine waiting for the rest: close the connection."""
        if not writer.cancelled() and writer.exception() is not None:
            self.close()

    async def _drained(self) -> None:
        if self.lost:
            raise UpstreamBroke("the engine closed the connection", before_answer=False)
        if self._write_paused:
            self._drain = self._loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None

    def taken(self) -> None:
        """The consumer took the buffered body: read from the engine again."""
        if self._read_paused and self._transport is not None and not self.lost:
            self._read_paused = False
            self._last_read = self._loop.time()
            self._transport.resume_reading()

    def abandon(self, answer: Answer) -> None:
        """The consumer gave up `answer` before its end: the connection cannot be reused."""
        if self._answer is answer:
            self._answer = None
            self.close()

    def close(self) -> None:
        """Close the connection (the engine sees the client leave)."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    # --- the read timeout (the pool's watchdog asks) --------------------------------------

    @property
    def waiting(self) -> bool:
        """Whether an answer is being read (the watchdog forgets connections that are not)."""
        return self._answer is not None

    def check_read_timeout(self, now: float, timeout: float) -> None:
        """Fail the answer when the engine has sent nothing for `timeout` seconds.

        Reading paused for a slow client is not the engine's silence: the clock restarts.
        """
        if self._answer is None:
            return
        if self._read_paused:
            self._last_read = now
        elif now - self._last_read >= timeout:
            self._fail(UpstreamTimeout(f"the engine sent nothing for {timeout:g} s (read_timeout)"))

    def _fail(self, error: BaseException) -> None:
        answer, self._answer = self._answer, None
        if answer is not None:
            answer.fail(error)
        self.close()
