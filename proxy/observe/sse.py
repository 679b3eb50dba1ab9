"""SSE framing: bytes in, whole events out, and each event's data as the SSE spec joins it.

An event ends at a blank line. Lines end in `\\n` or `\\r\\n`, mixed freely, so a blank line
is `\\n\\n` or `\\n\\r\\n` (the latter also ends `\\r\\n\\r\\n`). A lone `\\r` line end, which the
spec allows and no engine writes, is not recognised.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from proxy.observe.jsonscan import Buffer

__all__ = ["MAX_EVENT_BYTES", "DataLines", "data_lines", "events", "next_separator", "single_data_line"]

# An event larger than this is not held whole: it passes through while only a bounded
# tail of it is kept (usage sits at the end of an event, and the carry stays bounded).
MAX_EVENT_BYTES = 1 << 20


def next_separator(data: Buffer, pos: int, end: int) -> tuple[int, int]:
    """(body_end, event_end) of the first blank line at or after pos; (-1, -1) if none."""
    lf = data.find(b"\n\n", pos, end)
    crlf = data.find(b"\n\r\n", pos, end)
    if crlf != -1 and (lf == -1 or crlf < lf):
        return crlf, crlf + 3
    if lf != -1:
        return lf, lf + 2
    return -1, -1


def events(data: Buffer, pos: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(start, body_end, event_end) of each complete event in data[pos:end], in order.

    Each separator kind is searched again only once the cursor has passed its last hit:
    searching both afresh for every event rescans the rest of the chunk each time, which is
    quadratic in a 60 KB burst of 256 events (an engine at full speed).
    """
    lf = crlf = -2
    cursor = pos
    while True:
        if lf != -1 and lf < cursor:
            lf = data.find(b"\n\n", cursor, end)
        if crlf != -1 and crlf < cursor:
            crlf = data.find(b"\n\r\n", cursor, end)
        if crlf != -1 and (lf == -1 or crlf < lf):
            yield cursor, crlf, crlf + 3
            cursor = crlf + 3
        elif lf != -1:
            yield cursor, lf, lf + 2
            cursor = lf + 2
        else:
            return


def single_data_line(data: Buffer, start: int, body_end: int) -> tuple[int, int]:
    """(start, end) of the value of an event that is one `data:` line (the engines' way); (-1, -1) if not."""
    if not data.startswith(b"data:", start) or data.find(b"\n", start, body_end) != -1:
        return -1, -1
    value = start + 5
    if value < body_end and data[value] == 0x20:
        value += 1
    end = body_end - 1 if body_end > value and data[body_end - 1] == 0x0D else body_end
    return value, end


@dataclass(frozen=True, slots=True)
class DataLines:
    """An event's data lines: their values joined with `\\n` (the spec's event data), and where each value sits."""

    payload: bytes
    spans: tuple[tuple[int, int], ...]  # (start, end) of each line's value in the event buffer

    def raw(self, offset: int) -> int:
        """The buffer index of a payload offset (a joining `\\n` maps to the end of its line's value)."""
        base = 0
        for start, end in self.spans:
            if offset <= base + (end - start):
                return start + offset - base
            base += end - start + 1
        return self.spans[-1][1]


def data_lines(data: Buffer, start: int, body_end: int) -> DataLines | None:
    """The data lines of the event data[start:body_end]; None when it has none (comments, `event:` only)."""
    spans: list[tuple[int, int]] = []
    pos = start
    while pos < body_end:
        line_end = data.find(b"\n", pos, body_end)
        if line_end == -1:
            line_end = body_end
        end = line_end - 1 if line_end > pos and data[line_end - 1] == 0x0D else line_end
        if data.startswith(b"data", pos) and (pos + 4 == end or data[pos + 4] == 0x3A):
            value = min(pos + 5, end)
            if value < end and data[value] == 0x20:
                value += 1
            spans.append((value, end))
        pos = line_end + 1
    if not spans:
        return None
    return DataLines(b"\n".join(bytes(data[s:e]) for s, e in spans), tuple(spans))
