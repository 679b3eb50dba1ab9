"""SSE framing: bytes in, whole events out, and each event's data as the SSE spec joins it.

An event ends at a blank line. Lines end in `\\n` or `\\r\\n`, mixed freely, so a blank line
is `\\n\\n` or `\\n\\r\\n` (the latter also ends `\\r\\n\\r\\n`). A lone `\\r` line end, which the
spec allows and no engine writes, is not recognised.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.observe.jsonscan import Buffer

__all__ = ["CRLF_BLANK", "LF_BLANK", "MAX_EVENT_BYTES", "DataLines", "data_lines", "next_separator"]

# A blank line ends an event; `\n\r\n` also ends `\r\n\r\n` and `\n` + `\r\n`.
LF_BLANK = b"\n\n"
CRLF_BLANK = b"\n\r\n"
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


def data_lines(data: Buffer, start: int, body_end: int, *, mid_line: bool = False) -> DataLines | None:
    """The data lines of the event data[start:body_end]; None when it has none (comments, `event:` only).

    `mid_line`: data[start:] is the end of an event whose start is gone (an event over
    MAX_EVENT_BYTES): its first line is taken to be the rest of a data line.
    """
    spans: list[tuple[int, int]] = []
    pos = start
    while pos < body_end:
        line_end = data.find(b"\n", pos, body_end)
        if line_end == -1:
            line_end = body_end
        end = line_end - 1 if line_end > pos and data[line_end - 1] == 0x0D else line_end
        if mid_line and pos == start:
            spans.append((pos, end))
        elif data.startswith(b"data", pos) and (pos + 4 == end or data[pos + 4] == 0x3A):
            value = min(pos + 5, end)
            if value < end and data[value] == 0x20:
                value += 1
            spans.append((value, end))
        pos = line_end + 1
    if not spans:
        return None
    return DataLines(b"\n".join(bytes(data[s:e]) for s, e in spans), tuple(spans))
