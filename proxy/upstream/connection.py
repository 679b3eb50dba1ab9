"""One keep-alive connection to the engine: asyncio protocol, responses parsed by httptools (llhttp).

Why not aiohttp's ClientSession: on this path it cost 75 µs of CPU per small request against
23 µs for a bare protocol (bench/client_leg.py, issue 19); the sidecar's own calls (reset,
detection, canary, metrics) still use it.
"""

from __future__ import annotations

import asyncio
import enum
import select
from time import perf_counter_ns
from typing import Protocol

import httptools

from proxy.upstream.body import write_body
from proxy.upstream.errors import UpstreamBadResponse, UpstreamBroke, UpstreamError, UpstreamTimeout
from proxy.upstream.head import Body, pieces_size
from proxy.upstream.response import UpstreamResponse
from proxy.upstream.response_head import MAX_HEADERS, HeadRefused, reason_text, response_headers

__all__ = ["Connection"]

# Up to _AT_ONCE a body's pieces go with the head in one writev, with no task (a 220 KB prompt,
# issue 34); a larger one is written by `write_body`, in slices.
_AT_ONCE = 1024 * 1024
# Readable while idle: the engine closed the connection (or sent bytes nobody asked for).
_PEER_CLOSED = select.POLLIN | select.POLLPRI


class _Phase(enum.Enum):
    """Where the connection is in its response: IDLE (none: pooled, or handed to a request not yet
    written), HEAD (within the head budget), BODY, or ENDED in the read being parsed: when that
    parse returns it goes back to the pool, or is closed if any byte followed the end (another
    head began: it belongs to no request, and pooled half-parsed it would go to the next)."""

    IDLE = 0
    HEAD = 1
    BODY = 2
    ENDED = 3


# The phases by module names: a member looked up on its Enum class costs ~160 ns in Python 3.11,
# and the per-request path looks one up about a dozen times.
_IDLE, _HEAD, _BODY, _ENDED = _Phase.IDLE, _Phase.HEAD, _Phase.BODY, _Phase.ENDED


class _BytesAfterResponse(Exception):
    """Raised from on_message_begin after the response ended: stop parsing what follows."""


class Pool(Protocol):
    """What a connection calls on the pool that holds it (proxy/upstream/leg.py's `UpstreamLeg`;
    a protocol, so that the two modules do not import each other)."""

    @property
    def max_head_bytes(self) -> int:
        """The largest response head taken from the engine."""

    answered_at: float | None
    """When (loop time) an answer's head below 500 last came in: the engine serves (proxy/health.py)."""

    def release(self, connection: Connection) -> None:
        """A connection whose response is complete: to a waiting request, else to the idle list."""

    def forget(self, connection: Connection) -> None:
        """A connection closed (by either side): it no longer counts, and a waiter may open one."""

    def watch(self, connection: Connection) -> None:
        """`connection` starts reading a response: watch it for read_timeout."""


class Connection(asyncio.Protocol):
    """A connection carries one response at a time; between responses it waits in the pool.

    State is explicit: `_phase` (above), `_response` the response being read (None unless HEAD
    or BODY), `lost` says the transport is gone. Every parser callback runs inside
    `data_received`, and only `data_received`, after the parse returns, hands the
    connection back to the pool.
    """

    # Slots: every read from the engine (each SSE event of a paced stream) touches this object
    # after the other streams' reads have pushed it out of the cache, and a slotted object's
    # fields are in the object, not in a values array of their own (issue 34).
    __slots__ = (
        "_drain",
        "_fields",
        "_head_left",
        "_head_only",
        "_informational",
        "_keep_alive",
        "_last_read",
        "_loop",
        "_max_head",
        "_parser",
        "_phase",
        "_poll",
        "_pool",
        "_quiet",
        "_raw_headers",
        "_read_paused",
        "_reason",
        "_response",
        "_reusable",
        "_transport",
        "_until_close",
        "_write_paused",
        "idle_since",
        "lost",
        "served",
    )

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._poll: select.poll | None = None  # the socket, to look for the engine's close before a write
        self._parser = httptools.HttpResponseParser(self)
        self._phase = _IDLE
        self._response: UpstreamResponse | None = None
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._fields = 0  # headers (or trailers) in the section being read
        self._reason = b""
        # Bytes the head may still take (1xx heads included), -1 once it is in.
        self._head_left = -1
        self._max_head = pool.max_head_bytes
        # Bytes read since the body last moved: past max_head_bytes they are trailers (or
        # chunk extensions) without end, which httptools would also grow by concatenation.
        self._quiet = 0
        self._keep_alive = False
        self._reusable = False  # the response that ended may leave the connection to the next request
        self._until_close = False  # a body with neither length nor chunks ends when the connection does
        self._informational = False  # a 1xx response: the real one follows on the same connection
        self._head_only = False  # the request was HEAD: no body follows the head
        self._drain: asyncio.Future[None] | None = None
        self._write_paused = False
        self._read_paused = False
        self._last_read = 0.0  # when the engine last sent a byte (read_timeout counts from it)
        self.served = 0  # responses completed on a kept connection: > 0 means it is a reused one
        self.idle_since = 0.0
        self.lost = False

    # --- asyncio protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._poll = select.poll()
            self._poll.register(sock.fileno(), _PEER_CLOSED)

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is None:
            # Bytes nobody asked for: this connection cannot carry another response.
            self.close()
            return
        self._last_read = self._loop.time()
        left = self._head_left
        if left >= 0:
            # The read that completes the head is where the sidecar's time on the answer starts.
            response.answer_read_ns = perf_counter_ns()
            if len(data) > left:
                self._past_head_budget(response, data, left)
                return
            self._head_left = left - len(data)
        else:
            self._quiet += len(data)
            if not response.body_read_ns:  # the first read of body after the head (a stream's first event)
                response.body_read_ns = perf_counter_ns()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._parse_failed(exc)
            return
        self._read_done(response)

    def _past_head_budget(self, response: UpstreamResponse, data: bytes, left: int) -> None:
        """A read that takes the head past its budget: the head must end within the budget."""
        view = memoryview(data)
        self._head_left = 0
        try:
            self._parser.feed_data(view[:left])
            if self._phase is not _HEAD:  # the head ended within the budget: the rest as usual
                self._parser.feed_data(view[left:])
        except httptools.HttpParserError as exc:
            self._parse_failed(exc)
            return
        if self._phase is _HEAD:
            limit = self._max_head
            self._fail(
                UpstreamBadResponse(f"the engine's answer head is past max_upstream_head_bytes ({limit})")
            )
        else:
            self._read_done(response)

    def _parse_failed(self, exc: Exception) -> None:
        """The parser refused the read: the response fails, or, if it ended already, what followed it is dropped."""
        if self._phase is _ENDED:
            # The response is whole; what followed it belongs to no request.
            self._phase = _IDLE
            self.close()
            return
        cause = exc.__context__
        why = (
            str(cause) if isinstance(cause, HeadRefused) else f"the engine's answer is not valid HTTP ({exc})"
        )
        self._fail(UpstreamBadResponse(why))

    def _read_done(self, response: UpstreamResponse) -> None:
        """The end of one read: the connection back to the pool if the response ended, else flow control."""
        phase = self._phase
        if phase is _ENDED:
            self._phase = _IDLE
            if not self._reusable:
                self.close()  # the engine asked to close, or our request body was not all sent
                return
            if self._read_paused:
                # The buffer that was full is the response's, now the consumer's alone.
                self._read_paused = False
                if self._transport is not None:
                    self._transport.resume_reading()
            self._pool.release(self)
        elif self._quiet > self._max_head and phase is _BODY:
            self._fail(UpstreamBadResponse("the engine's trailers are past max_upstream_head_bytes"))
        elif response.flush():
            self._pause_reading()

    def eof_received(self) -> bool:
        return False  # close our side too: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(UpstreamBroke("the engine closed the connection"))
        response, self._response = self._response, None
        self._phase = _IDLE
        if response is not None:
            if self._until_close and response.status:
                response.complete()
            else:
                what = "reset" if exc is not None else "closed"
                response.fail(UpstreamBroke(f"the engine {what} the connection before the answer ended"))
        self._pool.forget(self)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # --- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._phase is _ENDED:
            raise _BytesAfterResponse
        self._raw_headers, self._fields, self._reason = [], 0, b""

    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._fields > MAX_HEADERS:
            section = "headers" if self._phase is _HEAD else "trailers"
            raise HeadRefused(f"the engine's answer has more than {MAX_HEADERS} {section}")
        if self._phase is _HEAD:
            self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self._response
        assert response is not None  # data_received feeds the parser only while a response waits
        status = self._parser.get_status_code()
        if status < 200:
            self._informational = True  # 100 Continue, 103 Early Hints: not the response
            return
        if status < 500:
            self._pool.answered_at = self._last_read
        reason = reason_text(self._reason)
        headers = response_headers(self._raw_headers)
        self._phase, self._head_left, self._fields, self._quiet = _BODY, -1, 0, 0
        self._keep_alive = self._parser.should_keep_alive()
        self._until_close = (
            "Content-Length" not in headers
            and "Transfer-Encoding" not in headers
            and status not in (204, 304)
            and not self._head_only
        )
        response.head_ready(status, reason, headers)
        if self._head_only:
            # llhttp cannot be told that a HEAD response has no body: the response ends here,
            # and the connection with it.
            self._end(reusable=False)

    def on_body(self, body: bytes) -> None:
        self._quiet = 0
        response = self._response
        if response is not None and response.body(body):
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
        if self._response is None:
            return  # a HEAD response, ended at its head
        self.served += 1
        writing = self._response.writer is not None and not self._response.writer.done()
        self._end(reusable=self._keep_alive and not writing)

    def _end(self, *, reusable: bool) -> None:
        """The response is whole; what becomes of the connection is decided when the parse returns."""
        response, self._response = self._response, None
        self._phase, self._reusable = _ENDED, reusable
        assert response is not None
        response.complete()

    # --- used by the pool and the response ---------------------------------------------------

    async def exchange(self, head: bytes, body: Body, *, chunked: bool, head_only: bool) -> UpstreamResponse:
        """Write one request and wait for its response's head."""
        transport = self._transport
        if self.lost or transport is None or transport.is_closing() or (self.served and self._peer_closed()):
            # Found closed before anything was written: the request may go on another connection.
            self.close()
            raise UpstreamBroke("the pooled connection was closed", unsent=True)
        response = UpstreamResponse(self, self._loop.create_future())
        self._response, self._phase, self._head_only, self._until_close = response, _HEAD, head_only, False
        self._head_left, self._quiet = self._max_head, 0
        self._last_read = self._loop.time()
        self._pool.watch(self)
        if body is None:
            transport.write(head)
        elif isinstance(body, bytes):
            transport.write(head + body)  # one write: one packet for a small request
        elif isinstance(body, tuple) and pieces_size(body) <= _AT_ONCE:
            transport.writelines((head, *body))  # the pieces share the client's buffer: no copy
        else:
            transport.write(head)
            response.writer = self._loop.create_task(
                write_body(transport, body, chunked, self._drained, response)
            )
            response.writer.add_done_callback(self._body_written)
        if response.writer is None:
            response.sent_ns = perf_counter_ns()  # the request's last byte (write_body marks its own)
        try:
            if response.writer is None:
                await response.head_arrived
            else:
                await self._head_or_failed_body(response, response.writer)
        except BaseException:
            response.close()
            raise
        return response

    def _peer_closed(self) -> bool:
        """Whether the kernel holds the engine's close (or stray bytes) the loop has not seen yet:
        a request written now would reach an engine gone, and could not be sent again (issue 27)."""
        return self._poll is not None and bool(self._poll.poll(0))

    async def _head_or_failed_body(self, response: UpstreamResponse, writer: asyncio.Task[None]) -> None:
        """The head, unless writing the body failed first (the client's body too large, or gone)."""
        head = response.head_arrived
        await asyncio.wait((head, writer), return_when=asyncio.FIRST_COMPLETED)
        if writer.done() and not writer.cancelled():
            error = writer.exception()
            if error is not None and not isinstance(error, UpstreamError):
                # The client's body stopped it (too large, or the client left): that is the
                # cause, though closing the connection for it may have failed the response by now.
                raise error
        # A body the engine stopped reading (it closed): its response, or the connection's own error.
        await head

    def _body_written(self, writer: asyncio.Task[None]) -> None:
        """A body that failed half-way leaves the engine waiting for the rest: close the connection."""
        if not writer.cancelled() and writer.exception() is not None:
            self.close()

    async def _drained(self) -> None:
        if self.lost:
            raise UpstreamBroke("the engine closed the connection")
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

    def abandon(self, response: UpstreamResponse) -> None:
        """The consumer gave up `response` before its end: the connection cannot be reused."""
        if self._response is response:
            self._response, self._phase = None, _IDLE
            self.close()

    def close(self) -> None:
        """Close the connection (the engine sees the client leave)."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    # --- the read timeout (the pool's watchdog asks) --------------------------------------

    @property
    def waiting(self) -> bool:
        """Whether a response is being read (the watchdog forgets connections that are not)."""
        return self._response is not None

    def check_read_timeout(self, now: float, timeout: float) -> None:
        """Fail the response when the engine has sent nothing for `timeout` seconds.

        Reading paused for a slow client is not the engine's silence: the clock restarts.
        """
        if self._response is None:
            return
        if self._read_paused:
            self._last_read = now
        elif now - self._last_read >= timeout:
            self._fail(UpstreamTimeout(f"the engine sent nothing for {timeout:g} s (read_timeout)"))

    def _fail(self, error: BaseException) -> None:
        response, self._response = self._response, None
        self._phase = _IDLE
        if response is not None:
            response.fail(error)
        self.close()
