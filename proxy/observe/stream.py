"""Usage read out of an SSE answer as it streams, and the injection's traces taken out again.

Pass-through (no rules): every chunk goes to the client as it came (the same object) and
is only scanned. Stripping (the stream was injected into): events are framed and what the
engine's `StreamRules` say the injection added is removed byte-wise, never re-serialised.
A finish chunk waits in a `PendingFinish` (pending_finish.py) until the next data event, so that what
the engine put on the usage chunk for the stream's last event can move back onto it.
A read of many whole events, or its start, is first offered to burst.py, which answers it
with searches over the whole read instead of event by event.
"""

from __future__ import annotations

from proxy.observe.burst import READ_END, notable_search, plain_prefix, whole_read
from proxy.observe.jsonscan import Buffer, find_members, removal_cuts, without
from proxy.observe.markers import FINISH_KEY, NULL_TAIL, SIDE_MARKERS, USAGE_KEY
from proxy.observe.pending_finish import PendingFinish
from proxy.observe.rules import StreamRules, has_finish, is_usage_only
from proxy.observe.sse import CRLF_BLANK, LF_BLANK, MAX_EVENT_BYTES, DataLines, data_lines, next_separator
from proxy.observe.usage import NO_USAGE, Usage, first_id, usage_from_fragment, usage_from_json

__all__ = ["StreamScanner", "decode_count"]

_NULL_TAIL_LEN = len(NULL_TAIL)
_FINISH_KEY_LEN = len(FINISH_KEY)

# What is kept unsent of an event over MAX_EVENT_BYTES: its end, where usage and the
# closing brace (for members moved back) are.
_BIG_TAIL = 64 * 1024


class _DecodeCounter:
    """Counts JSON decodes done by the stream scanner, so tests can prove it stays lazy."""

    def __init__(self) -> None:
        self.value = 0


decode_count = _DecodeCounter()


class StreamScanner:
    """One SSE answer's scanner; `rules` given means the sidecar injected include_usage into it."""

    # Slots, and the one `_quiet` flag the per-read check reads: at a paced load a stream's
    # scanner is touched once every event, cold after the other streams' events, and each
    # object or line of memory that check reads is a cache miss (issue 34).
    __slots__ = (
        "_big",
        "_big_finish",
        "_carry",
        "_deferred",
        "_dropped",
        "_engine_id",
        "_finish",
        "_id_read",
        "_no_data",
        "_notable",
        "_pending",
        "_quiet",
        "_rules",
        "_saw_usage",
        "_usage",
        "_usage_chunk",
    )

    def __init__(self, rules: StreamRules | None = None) -> None:
        """Start with nothing seen."""
        self._rules = rules
        self._carry = bytearray()
        self._big: bytearray | None = None  # the unsent tail of an event over MAX_EVENT_BYTES
        self._big_finish = False
        self._usage = NO_USAGE
        self._saw_usage = False
        self._deferred: bytes | None = None  # latest side-marker event, decoded lazily
        self._engine_id: str | None = None
        self._id_read = False
        self._pending = PendingFinish(rules.last_event_members if rules is not None else None)
        self._notable = notable_search(rules)
        self._usage_chunk = b""  # the payload of the usage chunk just dropped
        # What the event just scanned was: sets `finish_reason`, was dropped, has no data.
        self._finish = self._dropped = self._no_data = False
        # Nothing held, nothing carried and the engine's id read: a read of whole events
        # with nothing notable in them goes out as it is (kept by feed(), which alone
        # changes what it sums up).
        self._quiet = False

    @property
    def usage(self) -> Usage:
        """Best knowledge so far."""
        self._apply_deferred()
        return self._usage

    @property
    def saw_usage(self) -> bool:
        """Whether any event carried a usage object or one of the engines' metrics blocks."""
        return self._saw_usage or self._deferred is not None

    @property
    def engine_id(self) -> str | None:
        """The engine's own id for the answer: the first `id` of its first data event."""
        return self._engine_id

    def feed(self, chunk: bytes) -> bytes:
        """Scan one chunk of the answer and return the bytes to write to the client now.

        Passing through, that is `chunk` itself; stripping, what of it (and of what came
        before) can go now.
        """
        if self._quiet and chunk.endswith(READ_END) and self._notable(chunk) is None:
            return chunk  # whole events, nothing in them to read or cut, nothing held before them
        emitted = self._feed(chunk)
        self._quiet = (
            self._id_read and not self._carry and self._big is None and self._pending.pending is None
        )
        return emitted

    def _feed(self, chunk: bytes) -> bytes:
        """feed() for a read that is not plainly quiet."""
        strip = self._rules is not None
        if not chunk:
            return chunk
        if self._big is not None:
            emitted = self._feed_big(chunk)
            return emitted if strip else chunk
        if self._carry:
            emitted = self._feed_framed(chunk)
        else:
            cut = 0
            if self._pending.pending is None and self._knows_id(chunk):
                whole = whole_read(chunk, self._rules)
                if whole is not None:
                    return whole
                # The plain events a read starts with go at once; from the first that has
                # something to read (a burst's last read: the finish and usage chunks), one by one.
                cut = plain_prefix(chunk, self._rules)
            emitted = self._feed_framed(chunk[cut:] if cut else chunk)
            if cut and strip:
                emitted = chunk[:cut] + emitted
        return emitted if strip else chunk

    def _knows_id(self, chunk: bytes) -> bool:
        """Whether the engine's id is known, reading it from the read's first event if need be.

        On the stream's first read the id is read here, as the per-event path reads it, when
        that event is one `data:` line; otherwise that path reads it.
        """
        if self._id_read:
            return True
        line_end = chunk.find(b"\n")
        if not chunk.startswith(b"data:") or chunk[line_end + 1 : line_end + 2] != b"\n":
            return False
        self._id_read = True
        self._engine_id = first_id(chunk, 5, line_end - 1 if chunk[line_end - 1] == 0x0D else line_end)
        return True

    def _feed_framed(self, chunk: bytes) -> bytes:
        """Frame the chunk's events one by one (after what is carried); what can go now, stripping."""
        # Frame the chunk in place when nothing is carried (the usual case: engines write
        # whole events); otherwise append to the carry and frame that.
        strip = self._rules is not None
        data: bytes | bytearray = chunk
        search_from = 0
        if self._carry:
            search_from = max(0, len(self._carry) - 2)  # a separator may straddle the reads
            self._carry += chunk
            data = self._carry
        out, consumed = self._frame(data, search_from)
        emitted = b""
        if strip:
            if out is not None:
                emitted = out
            elif data is chunk and consumed == len(chunk):
                emitted = chunk
            else:
                emitted = bytes(data[:consumed])
        if data is self._carry:
            del self._carry[:consumed]
        elif consumed < len(chunk):
            self._carry += memoryview(chunk)[consumed:]
        if len(self._carry) > MAX_EVENT_BYTES:
            self._big, self._carry, self._big_finish = self._carry, bytearray(), False
            emitted += self._pending.release() + self._big_emit()
        return emitted

    def finish(self) -> bytes:
        """At the end of the answer: scan and return whatever is still buffered."""
        piece = b""
        if self._big is not None:
            big, self._big = self._big, None
            piece = self._big_event(big, len(big), len(big))
        elif self._carry:
            rest = bytes(self._carry)
            self._carry.clear()
            changed = self._event(rest, 0, len(rest), len(rest))
            piece = changed if changed is not None else rest
            if self._rules is not None:
                piece = self._through_pending(piece)
        self._apply_deferred()
        return self._pending.release() + piece if self._rules is not None else b""

    # -- framing ---------------------------------------------------------------------------
    def _frame(self, data: Buffer, search_from: int = 0) -> tuple[bytes | None, int]:
        """Scan every complete event in data: (replacement or None if nothing changed, bytes consumed)."""
        pieces: list[bytes] | None = None
        cursor = 0
        strip = self._rules is not None
        end = len(data)
        # Each blank-line kind (sse.py) is searched again only once the cursor has passed its
        # last hit: searching both afresh per event is quadratic in a burst of 256 events. The
        # loop is written out here, not a generator: that costs a tenth of a µs per event.
        lf = crlf = -2
        while True:
            if lf != -1 and lf < cursor:
                lf = data.find(LF_BLANK, max(cursor, search_from), end)
            if crlf != -1 and crlf < cursor:
                crlf = data.find(CRLF_BLANK, max(cursor, search_from), end)
            if crlf != -1 and (lf == -1 or crlf < lf):
                start, body_end, event_end = cursor, crlf, crlf + 3
            elif lf != -1:
                start, body_end, event_end = cursor, lf, lf + 2
            else:
                break
            changed = self._event(data, start, body_end, event_end)
            if strip and (self._pending.pending is not None or self._finish or self._dropped):
                if pieces is None:
                    pieces = [bytes(data[:start])]
                piece = changed if changed is not None else bytes(data[start:event_end])
                pieces.append(self._through_pending(piece))
            elif changed is not None or pieces is not None:
                if pieces is None:
                    pieces = [bytes(data[:start])]
                pieces.append(changed if changed is not None else bytes(data[start:event_end]))
            cursor = event_end
        return (b"".join(pieces) if pieces is not None else None), cursor

    # -- one event -------------------------------------------------------------------------
    def _event(self, data: Buffer, start: int, body_end: int, event_end: int) -> bytes | None:
        """Scan the event data[start:event_end]; its stripped bytes, or None if unchanged."""
        rules = self._rules
        if rules is None:
            # Passing through, an event with nothing to read goes by on four searches (the
            # usual content chunk: this runs for every token of every stream).
            if (
                self._id_read
                and data.find(USAGE_KEY, start, body_end) == -1
                and data.find(SIDE_MARKERS[0], start, body_end) == -1
                and data.find(SIDE_MARKERS[1], start, body_end) == -1
                and data.find(SIDE_MARKERS[2], start, body_end) == -1
                and data.find(SIDE_MARKERS[3], start, body_end) == -1
            ):
                return None
        else:
            self._finish = self._dropped = self._no_data = False
        lines: DataLines | None = None
        buf: Buffer = data
        if data.startswith(b"data:", start) and data.find(b"\n", start, body_end) == -1:
            # One `data:` line, as engines write events (inlined: this runs for every token).
            # s may keep the value's leading space: nothing searched for starts with one.
            s, e = start + 5, body_end - 1 if data[body_end - 1] == 0x0D else body_end
        else:
            lines = data_lines(data, start, body_end)
            if lines is None:
                self._no_data = True
                return None
            buf, s, e = lines.payload, 0, len(lines.payload)
        if not self._id_read:
            self._id_read = True
            self._engine_id = first_id(buf, s, e)
        if rules is not None:
            pos = buf.find(FINISH_KEY, s, e)
            if pos != -1:
                # `"finish_reason":null` on every content chunk, `:"stop"` on the finish chunk:
                # the compact forms answered at once, any other spacing by the scanner.
                follows = buf[pos + _FINISH_KEY_LEN : pos + _FINISH_KEY_LEN + 2]
                self._finish = follows == b':"' or (follows != b":n" and has_finish(buf, pos, e))
        first = buf.find(USAGE_KEY, s, e)
        if first == -1:
            self._note_side_markers(buf, s, e)
            return None
        if lines is None and first == e - _NULL_TAIL_LEN + 1 and data.startswith(NULL_TAIL, first - 1):
            # The usual content chunk under injection: `..., "usage":null}` as its only usage
            # member, last. Same result as the general path, minus its allocations: this runs
            # for every token of every stream.
            self._note_side_markers(data, s, e)
            if rules is not None and rules.null_usage_added:
                return b"".join((data[start : first - 1], data[e - 1 : event_end]))
            return None
        members = find_members(buf, USAGE_KEY, s, e)
        if not any(m.is_object for m in members):
            self._note_side_markers(buf, s, e)
            if rules is not None and rules.null_usage_added and members:
                return self._cut(data, start, event_end, lines, removal_cuts(buf, s, e, members))
            return None
        self._apply_deferred()
        decode_count.value += 1
        self._usage = self._usage.merged(usage_from_json(buf[s:e]))
        self._saw_usage = True
        if rules is None:
            return None
        if is_usage_only(buf, s, e):
            self._dropped = True
            self._usage_chunk = bytes(buf[s:e])
            return b""
        removable = [m for m in members if m.is_object or rules.null_usage_added]
        return self._cut(data, start, event_end, lines, removal_cuts(buf, s, e, removable))

    @staticmethod
    def _cut(
        data: Buffer, start: int, event_end: int, lines: DataLines | None, cuts: list[tuple[int, int]]
    ) -> bytes:
        """The event without the cut ranges (given in payload offsets when the data spans lines)."""
        if lines is not None:
            cuts = [(lines.raw(a), lines.raw(b)) for a, b in cuts]
        return without(data, start, event_end, cuts)

    def _through_pending(self, piece: bytes) -> bytes:
        """Pass one scanned event through the pending finish chunk; the bytes to emit now."""
        dropped = self._usage_chunk if self._dropped else None
        return self._pending.take(piece, finish=self._finish, dropped_usage=dropped, no_data=self._no_data)

    # -- events over MAX_EVENT_BYTES ---------------------------------------------------------
    def _big_emit(self) -> bytes:
        """Let all but the last _BIG_TAIL bytes of the big event go; note a finish_reason in them."""
        big = self._big
        assert big is not None
        cut = len(big) - _BIG_TAIL
        if cut <= 0:
            return b""
        out = b""
        if self._rules is not None:
            out = bytes(big[:cut])
            # The member may straddle the cut: look a little past it.
            self._big_finish = self._big_finish or has_finish(big, 0, cut + 64)
        del big[:cut]
        return out

    def _feed_big(self, chunk: bytes) -> bytes:
        """Pass a big event through until its blank line, then frame again."""
        big = self._big
        assert big is not None
        scan_from = max(0, len(big) - 2)  # a separator may straddle the chunks
        big += chunk
        body_end, event_end = next_separator(big, scan_from, len(big))
        if body_end == -1:
            return self._big_emit()
        self._big = None
        rest = bytes(big[event_end:])
        finish = self._big_finish or has_finish(big, 0, body_end)
        piece = self._big_event(big, body_end, event_end)
        self._finish, self._dropped, self._no_data = finish, False, False
        emitted = self._through_pending(piece) if self._rules is not None else b""
        # Passing through, feed() hands back `rest` itself and what is returned here is unused.
        return emitted + self.feed(rest) if rest else emitted

    def _big_event(self, big: bytearray, body_end: int, event_end: int) -> bytes:
        """The kept end of a big event: its usage read member by member, the injection's traces cut."""
        lines = data_lines(big, 0, body_end, mid_line=True)
        if lines is None:
            return bytes(big[:event_end])
        payload = lines.payload
        usage = usage_from_fragment(payload, 0, len(payload))
        if usage is not None:
            self._apply_deferred()
            self._usage = self._usage.merged(usage)
            self._saw_usage = True
        rules = self._rules
        if rules is None:
            return b""
        members = [
            m
            for m in find_members(payload, USAGE_KEY, 0, len(payload))
            if m.is_object or rules.null_usage_added
        ]
        return self._cut(big, 0, event_end, lines, removal_cuts(payload, 0, len(payload), members))

    # -- lazily decoded metrics blocks -------------------------------------------------------
    def _note_side_markers(self, data: Buffer, start: int, end: int) -> None:
        """Keep the event for a lazy decode if it carries one of the engines' metrics blocks."""
        for marker in SIDE_MARKERS:
            if data.find(marker, start, end) != -1:
                # Cumulative blocks (SGLang /generate meta_info, mindnano_metrics) ride on
                # every event: keep the latest, decode once when asked.
                self._deferred = bytes(data[start:end])
                return

    def _apply_deferred(self) -> None:
        """Decode the latest side-marker event, if one is waiting."""
        if self._deferred is None:
            return
        event, self._deferred = self._deferred, None
        decode_count.value += 1
        self._usage = self._usage.merged(usage_from_json(event))
        self._saw_usage = True
