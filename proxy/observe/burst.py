"""Reads of many SSE events answered at once, by searches over the read instead of per event.

Engines write whole events, and a sidecar that is busy finds many waiting at each read, most
of them content chunks with nothing in them to read or cut. Whether a read (or the start of
one) is such a run of events is decided here with a few searches over all of it; the stream
scanner (stream.py) scans the rest event by event. Both functions assume what the scanner
checks first: nothing is held back (a finish chunk waiting for the usage chunk) and the
engine's id is known.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from proxy.observe.markers import FINISH_KEY, FINISH_NULL, NULL_TAIL, SIDE_MARKERS, USAGE_KEY
from proxy.observe.rules import StreamRules

__all__ = ["READ_END", "notable_search", "plain_prefix", "whole_read"]

# A read's last bytes when its last event is whole, and the injected null at an event's end.
# (A read ending in more blank lines is whole too: the per-event path would carry the last
# one to the next read, where an empty line before an event changes nothing.)
READ_END = b"\n\n"
_NULL_TAIL_EVENT = NULL_TAIL + READ_END
_NULL_CUT_EVENT = b"}" + READ_END
_DATA_EVENT = READ_END + b"data:"
# What ends a read's plain prefix when stripping: usage, a metrics block, a finish set compactly.
_PREFIX_MARKERS = (USAGE_KEY, *SIDE_MARKERS, b'"finish_reason":"')
# Whatever makes a read of whole events worth reading: usage, a metrics block, and, when
# stripping, a `finish_reason` set to anything but null. A read without any goes out as it is
# on one search (the usual content chunk, once per token of every stream: at a paced load,
# 5 µs per event through the general path, issue 34). A false hit only sends the read the
# general way.
_NOTABLE = b"|".join(re.escape(marker) for marker in (USAGE_KEY, *SIDE_MARKERS))
_NOTABLE_PASSING = re.compile(_NOTABLE).search
# A `finish_reason` is notable unless `:null` follows it on the same line (spaces or tabs around
# the colon): one whose value is on a later `data:` line of the event goes the general way, which
# joins the lines.
_NOTABLE_STRIPPING = re.compile(_NOTABLE + b"|" + re.escape(FINISH_KEY) + rb"(?![ \t]*:[ \t]*null)").search


def notable_search(rules: StreamRules | None) -> Callable[[bytes], re.Match[bytes] | None]:
    """The one search that finds whatever a read of whole events must be scanned for (None:
    a quiet read, which the scanner returns as it is when it holds nothing; `rules` as below)."""
    return _NOTABLE_PASSING if rules is None else _NOTABLE_STRIPPING


def whole_read(chunk: bytes, rules: StreamRules | None) -> bytes | None:
    """What goes out for a read of whole events with nothing to read in any; None: not such a read.

    `rules`: the engine's, when the stream was injected into (None: passed through). Content
    chunks are answered with a few searches over the whole read instead of several per event
    (bench/scanner_cost.py, issue 19: stripped, vLLM's shape, 2.1 -> 1.2 µs per event one
    event per read, 1.7 -> 0.5 in 256-event reads; passed through 1.5 -> 0.9 and 1.1 -> 0.3).
    No event may carry usage, a metrics block or a set `finish_reason` — except the injected
    `,"usage":null}` ending single-line `data:` events, cut as the per-event path cuts it.
    """
    if not chunk.endswith(READ_END):
        return None
    for marker in SIDE_MARKERS:
        if marker in chunk:
            return None
    if rules is not None and chunk.count(FINISH_KEY) != chunk.count(FINISH_NULL):
        return None
    usages = chunk.count(USAGE_KEY)
    if not usages:
        return chunk
    if usages != chunk.count(_NULL_TAIL_EVENT):
        return None
    # Every event one `data:` line (so each null above ends one, as its only usage): the
    # events start at 0 and after each blank line, and there are as many newlines as
    # twice the blank lines.
    events = chunk.count(READ_END)
    data_events = chunk.count(_DATA_EVENT) + chunk.startswith(b"data:")
    if data_events != events or chunk.count(b"\n") != 2 * events:
        return None
    if rules is None or not rules.null_usage_added:
        return chunk
    return chunk.replace(_NULL_TAIL_EVENT, _NULL_CUT_EVENT)


def plain_prefix(chunk: bytes, rules: StreamRules | None) -> int:
    """How many bytes a read starts with of whole events with nothing to read in any; 0: none.

    The events before the first usage, metrics block or set `finish_reason` (compact
    `"finish_reason":"`, any other form in them refuses the lot), up to the blank line before
    it; at the read's last blank line when there is none. A burst's last read (its content
    chunks, then the finish and usage chunks) and a read that ends inside an event no longer go
    event by event from the start (bench/scanner_cost.py, 100-event reads, stripped, vLLM's
    shape: 0.84 -> 0.58 µs per event).
    """
    first = len(chunk)
    for marker in (USAGE_KEY, *SIDE_MARKERS) if rules is None else _PREFIX_MARKERS:
        at = chunk.find(marker, 0, first)
        if at != -1:
            first = at
    end = chunk.rfind(READ_END, 0, first)
    if end == -1:
        return 0
    end += len(READ_END)
    if rules is not None and chunk.count(FINISH_KEY, 0, end) != chunk.count(FINISH_NULL, 0, end):
        return 0
    return end
