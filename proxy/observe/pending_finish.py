"""The pending finish chunk: members an engine puts on a stream's last event go back where they belong.

Engines attach some members to the stream's LAST event (vLLM `system_fingerprint`,
llama.cpp `timings`): with include_usage that is the usage chunk, without it the finish
chunk. So a finish chunk (`finish_reason` set) waits until the next data event — the
usage chunk follows it at once; comments (`: ping`) and data-less events may come between
and wait after it, in order — and the rules' members on a dropped usage chunk move back
onto it. No other event ever waits.
"""

from __future__ import annotations

from proxy.observe.rules import moved_members, with_members

__all__ = ["PendingFinish"]


class PendingFinish:
    """At most one finish chunk, and what came after it, waiting for the next data event."""

    def __init__(self, last_event_members: frozenset[bytes] | None) -> None:
        """Nothing pending; `last_event_members` as in the engine's StreamRules."""
        self._names = last_event_members
        self.pending: bytes | None = None
        self._after: list[bytes] = []

    def take(self, piece: bytes, *, finish: bool, dropped_usage: bytes | None, no_data: bool) -> bytes:
        """Pass one scanned event through; the bytes to emit now.

        `dropped_usage`: the payload of the usage chunk this event was (and which is not
        emitted); `no_data`: the event is a comment or has no data line.
        """
        if dropped_usage is not None:
            if self.pending is None:
                return b""
            self.pending = with_members(self.pending, moved_members(dropped_usage, self.pending, self._names))
            return self.release()
        if self.pending is not None:
            if no_data:
                self._after.append(piece)
                return b""
            out = self.release()
            if finish:
                self.pending = piece
                return out
            return out + piece
        if finish:
            self.pending = piece
            return b""
        return piece

    def release(self) -> bytes:
        """The pending finish chunk and what came after it, now let go."""
        if self.pending is None:
            return b""
        out = b"".join((self.pending, *self._after))
        self.pending, self._after = None, []
        return out
