"""Cached-token extraction (JSON and SSE), include_usage injection and stripping.

Pure functions and one small stateful scanner: nothing here does I/O. The
forwarding handler calls `prepare_request` on the request body, feeds the
response through a `StreamScanner` (or `usage_from_json` for a whole JSON body)
and builds an `Observation` for the evidence writer and the witness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "INJECTABLE_PATHS",
    "OBSERVED_PATHS",
    "Observation",
    "PreparedRequest",
    "StreamScanner",
    "Usage",
    "decode_count",
    "is_observed",
    "prepare_request",
    "usage_from_json",
]

OBSERVED_PATHS: frozenset[str] = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/completion",
        "/generate",
    }
)

# Only the OpenAI chat/completions routes know `stream_options`. SGLang's native
# /generate and llama.cpp's /completion have no such field; /v1/responses
# (`response.completed`) and /v1/messages (`message_start`/`message_delta`)
# streams already carry usage in their own events, so nothing is injected there.
INJECTABLE_PATHS: frozenset[str] = frozenset({"/v1/chat/completions", "/v1/completions"})

# SSE events larger than this are passed through unscanned: no usage event is
# anywhere near this size, and the carry buffer must stay bounded.
MAX_EVENT_BYTES = 1 << 20

_USAGE_KEY = b'"usage"'
# Markers of the other places numbers live (llama.cpp, SGLang /generate, mindnano).
_SIDE_MARKERS = (b'"timings"', b'"meta_info"', b'"mindnano_metrics"')
_WS = b" \t\r\n"
# How an injected `"usage":null` usually ends a content chunk (compact JSON, usage last).
_NULL_TAIL = b',"usage":null}'
_NULL_TAIL_LEN = len(_NULL_TAIL)


class _DecodeCounter:
    """Counts JSON decodes done by the stream scanner, so tests can prove it stays lazy."""

    def __init__(self) -> None:
        self.value = 0


decode_count = _DecodeCounter()


def is_observed(method: str, path: str) -> bool:
    """Whether a forwarded request is an inference request that gets an observation."""
    return method == "POST" and path in OBSERVED_PATHS


@dataclass(frozen=True)
class PreparedRequest:
    """The request body to send upstream and what was learnt reading it."""

    body: bytes
    stream: bool
    model: str | None
    usage_injected: bool


def prepare_request(body: bytes, *, inject_usage: bool, path: str | None = None) -> PreparedRequest:
    """Read `stream`/`model` and add `stream_options.include_usage` when allowed; never raises.

    `path`, when given, limits injection to `INJECTABLE_PATHS`; None means the
    caller has already decided the route takes `stream_options`.
    """
    try:
        payload = orjson.loads(body)
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return PreparedRequest(body=body, stream=False, model=None, usage_injected=False)
    if not isinstance(payload, dict):
        return PreparedRequest(body=body, stream=False, model=None, usage_injected=False)
    stream = payload.get("stream") is True
    model = payload.get("model") if isinstance(payload.get("model"), str) else None
    unchanged = PreparedRequest(body=body, stream=stream, model=model, usage_injected=False)
    # vLLM answers 400 to stream_options when stream is false: only touch streams.
    if not (inject_usage and stream) or (path is not None and path not in INJECTABLE_PATHS):
        return unchanged
    options = payload.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        return unchanged  # malformed: let the engine answer the client's own mistake
    if options.get("include_usage") is True:
        return unchanged  # the client asked for usage itself and must get it
    payload["stream_options"] = {**options, "include_usage": True}
    try:
        rewritten = orjson.dumps(payload)
    except (orjson.JSONEncodeError, TypeError):
        return unchanged
    return PreparedRequest(body=rewritten, stream=stream, model=model, usage_injected=True)


@dataclass(frozen=True)
class Usage:
    """Token counts an engine reported; None wherever it did not say (never 0 for unknown)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_tokens_source: str | None = None

    def merged(self, newer: Usage) -> Usage:
        """Field-wise update: what `newer` knows wins, what it doesn't keeps the old value."""
        cached, source = self.cached_tokens, self.cached_tokens_source
        if newer.cached_tokens is not None:
            cached, source = newer.cached_tokens, newer.cached_tokens_source
        return Usage(
            prompt_tokens=newer.prompt_tokens if newer.prompt_tokens is not None else self.prompt_tokens,
            completion_tokens=(
                newer.completion_tokens if newer.completion_tokens is not None else self.completion_tokens
            ),
            cached_tokens=cached,
            cached_tokens_source=source,
        )


_NO_USAGE = Usage()


def _int(value: Any) -> int | None:
    """A token count: a non-negative int, not a bool."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _dig(obj: Any, *keys: str) -> Any:
    """obj[k1][k2]... or None when any step is missing or not an object."""
    for key in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _usage_block(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The `usage` object: top level (OpenAI), under `response` (Responses API
    `response.completed`) or under `message` (Messages API `message_start`)."""
    for candidate in (obj.get("usage"), _dig(obj, "response", "usage"), _dig(obj, "message", "usage")):
        if isinstance(candidate, dict):
            return candidate
    return None


_DETAILS_SOURCE = "usage.prompt_tokens_details.cached_tokens"


def _usage_from_object(obj: Any) -> Usage:
    """Token counts from one decoded response body or stream event."""
    if not isinstance(obj, dict):
        return _NO_USAGE
    usage = obj.get("usage")
    # The shape nearly every answer has (OpenAI usage with prompt_tokens_details): read it
    # without walking the other engines' fields — this runs for every observed request.
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached = _int(details.get("cached_tokens"))
            prompt = _int(usage.get("prompt_tokens"))
            completion = _int(usage.get("completion_tokens"))
            if cached is not None and prompt is not None and completion is not None:
                return Usage(prompt, completion, cached, _DETAILS_SOURCE)
    usage = _usage_block(obj) or {}
    # The SPEC's order (§5.2), then llama.cpp's /v1/messages field.
    # llama.cpp's `tokens_cached` is the slot's whole length, not a hit count: never read.
    cached_fields: tuple[tuple[str, Any], ...] = (
        (_DETAILS_SOURCE, _dig(usage, "prompt_tokens_details", "cached_tokens")),
        ("usage.input_tokens_details.cached_tokens", _dig(usage, "input_tokens_details", "cached_tokens")),
        ("timings.cache_n", _dig(obj, "timings", "cache_n")),
        ("meta_info.cached_tokens", _dig(obj, "meta_info", "cached_tokens")),
        ("mindnano_metrics.cached_tokens", _dig(obj, "mindnano_metrics", "cached_tokens")),
        ("usage.cache_read_input_tokens", usage.get("cache_read_input_tokens")),
    )
    cached, source = None, None
    for name, value in cached_fields:
        if _int(value) is not None:
            cached, source = _int(value), name
            break
    return Usage(
        prompt_tokens=_prompt_tokens(obj, usage),
        completion_tokens=_first_int(
            usage.get("completion_tokens"),
            usage.get("output_tokens"),
            _dig(obj, "meta_info", "completion_tokens"),
            _dig(obj, "timings", "predicted_n"),
        ),
        cached_tokens=cached,
        cached_tokens_source=source,
    )


def _prompt_tokens(obj: dict[str, Any], usage: dict[str, Any]) -> int | None:
    """The whole prompt's length, cached part included.

    Sources in order: `usage.prompt_tokens` (OpenAI chat/completions, all engines);
    `usage.input_tokens` (Responses API; Messages API adds
    `cache_read_input_tokens` + `cache_creation_input_tokens`, because Anthropic's
    `input_tokens` excludes them — llama.cpp sends `n_prompt - n_cache` there);
    `meta_info.prompt_tokens` (SGLang /generate); `timings.prompt_n + cache_n`
    (llama.cpp: `prompt_n` counts only the tokens it evaluated).
    """
    prompt = _int(usage.get("prompt_tokens"))
    if prompt is not None:
        return prompt
    prompt = _int(usage.get("input_tokens"))
    if prompt is not None:
        extra = (_int(usage.get("cache_read_input_tokens")) or 0) + (
            _int(usage.get("cache_creation_input_tokens")) or 0
        )
        return prompt + extra
    prompt = _int(_dig(obj, "meta_info", "prompt_tokens"))
    if prompt is not None:
        return prompt
    evaluated, cached = _int(_dig(obj, "timings", "prompt_n")), _int(_dig(obj, "timings", "cache_n"))
    if evaluated is not None and cached is not None:
        return evaluated + cached
    return None


def _first_int(*values: Any) -> int | None:
    """The first value that is a token count."""
    for value in values:
        if _int(value) is not None:
            return _int(value)
    return None


def usage_from_json(body: bytes) -> Usage:
    """Token counts from a complete (non-stream) JSON response body; never raises."""
    try:
        return _usage_from_object(orjson.loads(body))
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return _NO_USAGE


def _skip_ws(data: bytes | bytearray, pos: int, end: int) -> int:
    """First index at or after pos, before end, that is not JSON whitespace."""
    while pos < end and data[pos] in _WS:
        pos += 1
    return pos


def _skip_ws_back(data: bytes | bytearray, pos: int, start: int) -> int:
    """Index just after the last non-whitespace byte before pos (not below start)."""
    while pos > start and data[pos - 1] in _WS:
        pos -= 1
    return pos


def _object_end(data: bytes | bytearray, pos: int, end: int) -> int:
    """Index just after the JSON object that opens at pos, or -1 if it does not close by end."""
    depth = 0
    in_string = False
    i = pos
    while i < end:
        byte = data[i]
        if in_string:
            if byte == 0x5C:  # backslash: skip the escaped byte
                i += 1
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte == 0x7B:
            depth += 1
        elif byte == 0x7D:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


@dataclass(frozen=True)
class _Member:
    """Where a `"usage": value` member sits in an event, and what its value is."""

    key_start: int
    value_start: int
    value_end: int
    is_object: bool


def _find_usage_members(data: bytes | bytearray, start: int, end: int) -> list[_Member]:
    """Every `"usage": null|{...}` member in data[start:end], found with bytes.find.

    A match counts only when its opening quote is not escaped and a colon
    follows: inside a JSON string every quote is escaped, so such a match is a key.
    """
    members: list[_Member] = []
    pos = data.find(_USAGE_KEY, start, end)
    while pos != -1:
        after = pos + len(_USAGE_KEY)
        if pos > start and data[pos - 1] == 0x5C:
            pos = data.find(_USAGE_KEY, after, end)
            continue
        colon = _skip_ws(data, after, end)
        if colon < end and data[colon] == 0x3A:
            value = _skip_ws(data, colon + 1, end)
            if data.startswith(b"null", value):
                members.append(_Member(pos, value, value + 4, False))
                after = value + 4
            elif value < end and data[value] == 0x7B:
                close = _object_end(data, value, end)
                if close != -1:
                    members.append(_Member(pos, value, close, True))
                    after = close
        pos = data.find(_USAGE_KEY, after, end)
    return members


def _without_members(data: bytes | bytearray, start: int, end: int, members: list[_Member]) -> bytes:
    """data[start:end] with each member removed together with one adjoining comma.

    Removes `, "usage": x` when a comma precedes the member (the usual last-key
    case), else `"usage": x, ` with the comma and whitespace that follow — which
    is what the engine's serializer would have written without the member.
    """
    pieces: list[bytes] = []
    cursor = start
    for member in members:
        before = _skip_ws_back(data, member.key_start, cursor)
        if before > cursor and data[before - 1] == 0x2C:
            cut_from, cut_to = before - 1, member.value_end
        else:
            after = _skip_ws(data, member.value_end, end)
            if after < end and data[after] == 0x2C:
                cut_from, cut_to = member.key_start, _skip_ws(data, after + 1, end)
            else:
                cut_from, cut_to = member.key_start, member.value_end
        pieces.append(bytes(data[cursor:cut_from]))
        cursor = cut_to
    pieces.append(bytes(data[cursor:end]))
    return b"".join(pieces)


def _is_usage_only(data: bytes | bytearray, start: int, end: int) -> bool:
    """The include_usage chunk: `"choices": []` (OpenAI's empty choices on the usage chunk)."""
    pos = data.find(b'"choices"', start, end)
    if pos == -1:
        return False
    colon = _skip_ws(data, pos + 9, end)
    if colon >= end or data[colon] != 0x3A:
        return False
    bracket = _skip_ws(data, colon + 1, end)
    if bracket >= end or data[bracket] != 0x5B:
        return False
    close = _skip_ws(data, bracket + 1, end)
    return close < end and data[close] == 0x5D


def _data_payload(event: bytes) -> bytes:
    """The JSON after `data:` in one SSE event (single data line, as engines send)."""
    pos = event.find(b"data:")
    if pos == -1:
        return b""
    line_end = event.find(b"\n", pos)
    payload = event[pos + 5 : line_end if line_end != -1 else len(event)]
    return payload.strip()


def _next_separator(data: bytes | bytearray, pos: int, end: int) -> tuple[int, int]:
    """(start, length) of the first blank line (`\\n\\n` or `\\r\\n\\r\\n`) at or after pos; (-1, 0) if none."""
    lf = data.find(b"\n\n", pos, end)
    crlf = data.find(b"\r\n\r\n", pos, end)
    if crlf != -1 and (lf == -1 or crlf < lf):
        return crlf, 4
    if lf != -1:
        return lf, 2
    return -1, 0


_FINISH_MARKERS = (b'"finish_reason":"', b'"finish_reason": "')


def _is_finish_event(event: bytes) -> bool:
    """An event that ends a choice (`finish_reason` set): engines put last-event members after it."""
    return any(marker in event for marker in _FINISH_MARKERS)


def _value_end(data: bytes | bytearray, pos: int, end: int) -> int:
    """Index just after the JSON value that starts at pos (string, object, array or literal); -1 if cut."""
    if pos >= end:
        return -1
    first = data[pos]
    if first == 0x22:  # string
        i = pos + 1
        while i < end:
            if data[i] == 0x5C:
                i += 2
                continue
            if data[i] == 0x22:
                return i + 1
            i += 1
        return -1
    if first in (0x7B, 0x5B):  # object or array
        depth, in_string, i = 0, False, pos
        while i < end:
            byte = data[i]
            if in_string:
                if byte == 0x5C:
                    i += 1
                elif byte == 0x22:
                    in_string = False
            elif byte == 0x22:
                in_string = True
            elif byte in (0x7B, 0x5B):
                depth += 1
            elif byte in (0x7D, 0x5D):
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return -1
    i = pos
    while i < end and data[i] not in b",}] \t\r\n":
        i += 1
    return i


def _trailing_members(event: bytes, after: int, close: int) -> list[tuple[bytes, bytes]]:
    """(key, raw bytes with its leading comma) of each member in event[after:close], e.g. `,"k":v`."""
    members: list[tuple[bytes, bytes]] = []
    pos = after
    while True:
        comma = _skip_ws(event, pos, close)
        if comma >= close or event[comma] != 0x2C:
            return members
        key_start = _skip_ws(event, comma + 1, close)
        key_end = _value_end(event, key_start, close)
        if key_end == -1 or event[key_start] != 0x22:
            return members
        colon = _skip_ws(event, key_end, close)
        if colon >= close or event[colon] != 0x3A:
            return members
        value_end = _value_end(event, _skip_ws(event, colon + 1, close), close)
        if value_end == -1:
            return members
        members.append((event[key_start:key_end], event[pos:value_end]))
        pos = value_end


def _last_event_members(usage_event: bytes, finish_event: bytes) -> bytes:
    """The members an engine put after `usage` on its usage-only chunk that the finish chunk lacks.

    Engines attach some members to the stream's LAST event: vLLM `system_fingerprint`
    (seen on 0.32), llama.cpp `timings` (tools/server `deltas.back()`). Without
    include_usage that event is the finish chunk, so they belong back there.
    """
    members = _find_usage_members(usage_event, 0, len(usage_event))
    objects = [m for m in members if m.is_object]
    if not objects:
        return b""
    body_end = _skip_ws_back(usage_event, len(usage_event), 0)
    close = usage_event.rfind(b"}", 0, body_end)
    if close == -1:
        return b""
    moved = [
        raw
        for key, raw in _trailing_members(usage_event, objects[-1].value_end, close)
        if key + b":" not in finish_event and key + b" :" not in finish_event
    ]
    return b"".join(moved)


def _with_members(finish_event: bytes, members: bytes) -> bytes:
    """The finish event with raw `,"k":v` members added before its closing brace."""
    close = finish_event.rfind(b"}")
    if close == -1 or not members:
        return finish_event
    return finish_event[:close] + members + finish_event[close:]


class StreamScanner:
    """Reads usage out of an SSE response as it streams, and strips what injection added.

    With `strip_injected=False` every chunk is returned as is (the same object)
    and only scanned. With `strip_injected=True` events are framed on blank
    lines and the traces of an injected `include_usage` are removed byte-wise:
    the usage-only chunk (`"choices":[]`), every `"usage":null` member, and usage
    placed on a content chunk (llama.cpp /v1/completions puts it on the finish
    chunk).

    Engines attach some members to the stream's LAST event (vLLM
    `system_fingerprint`, llama.cpp `timings`): with include_usage that is the
    usage-only chunk, without it the finish chunk. So a finish chunk (one with
    `finish_reason` set) is held until the next event arrives — the usage chunk
    follows it at once — and the members after `usage` on a dropped usage chunk
    move back onto it, byte for byte. No other event is ever held back.

    `strip_null_usage=False` keeps `"usage":null` members, for engines that write
    them whether or not include_usage is on (SGLang before its msgspec encoder
    used pydantic `model_dump_json()`, which always wrote `"usage":null`).
    """

    def __init__(self, *, strip_injected: bool, strip_null_usage: bool = True) -> None:
        """Start with nothing seen."""
        self._strip = strip_injected
        self._strip_null = strip_null_usage
        self._carry = bytearray()
        self._oversize = False  # inside an event too large to frame: pass it through
        self._oversize_tail = b""
        self._usage = _NO_USAGE
        self._saw_usage = False
        self._deferred: bytes | None = None  # latest side-marker event, decoded lazily
        self._held: bytes | None = None  # a finish chunk waiting for the event after it
        self._dropped_usage: bytes | None = None  # the usage-only chunk just dropped

    @property
    def usage(self) -> Usage:
        """Best knowledge so far."""
        self._apply_deferred()
        return self._usage

    @property
    def saw_usage(self) -> bool:
        """Whether any event carried a usage object or one of the engines' metrics blocks."""
        return self._saw_usage or self._deferred is not None

    def feed(self, chunk: bytes) -> bytes:
        """Scan one chunk of the response and return the bytes to write to the client now."""
        if not chunk:
            return chunk
        if self._oversize:
            return self._feed_oversize(chunk)
        # Frame the chunk in place when nothing is carried (the usual case: engines
        # write whole events); otherwise append to the carry and frame that.
        data: bytes | bytearray = chunk
        if self._carry:
            self._carry += chunk
            data = self._carry
        out, consumed = self._frame(data, 0, len(data))
        emitted = b""
        if self._strip:
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
            # No usage event is this big: stop framing it and let it through.
            big = bytes(self._carry)
            self._carry.clear()
            self._oversize = True
            self._oversize_tail = big[-3:]
            emitted += self._release_held() + big
        return emitted if self._strip else chunk

    def finish(self) -> bytes:
        """At the end of the stream: scan and return whatever is still buffered."""
        rest = bytes(self._carry)
        self._carry.clear()
        if rest:
            out = self._event(rest, 0, len(rest), len(rest))
            rest = out if out is not None else rest
            if self._strip:
                rest = self._through_hold(rest, dropped=out == b"")
        self._oversize = False
        self._apply_deferred()
        return self._release_held() + rest if self._strip else b""

    def _release_held(self) -> bytes:
        """The held finish chunk (if any), now let go."""
        held, self._held = self._held, None
        return held or b""

    def _through_hold(self, piece: bytes, *, dropped: bool) -> bytes:
        """Pass one (stripped) event through the finish-chunk hold; return the bytes to emit now."""
        out = b""
        if self._held is not None:
            held, self._held = self._held, None
            if dropped and self._dropped_usage is not None:
                held = _with_members(held, _last_event_members(self._dropped_usage, held))
            out = held
        self._dropped_usage = None
        if piece and _is_finish_event(piece):
            self._held = piece
            return out
        return out + piece if out else piece

    def _feed_oversize(self, chunk: bytes) -> bytes:
        """Pass an oversize event through until its blank line, then frame again."""
        probe = self._oversize_tail + chunk  # a separator may straddle the chunks
        sep, length = _next_separator(probe, 0, len(probe))
        if sep == -1:
            self._oversize_tail = probe[-3:]
            return chunk
        resume_at = sep + length - len(self._oversize_tail)
        self._oversize = False
        self._oversize_tail = b""
        if resume_at >= len(chunk):
            return chunk
        rest = self.feed(chunk[resume_at:])
        return chunk[:resume_at] + rest if self._strip else chunk

    def _frame(self, data: bytes | bytearray, pos: int, end: int) -> tuple[bytes | None, int]:
        """Handle every complete event in data[pos:end].

        Returns (replacement, consumed): replacement is None when no event needed
        changing (so data[:consumed] goes out as is), else the bytes to emit.
        """
        pieces: list[bytes] | None = None
        cursor = pos
        # The next `\n\n` and `\r\n\r\n` at or after cursor, each searched again only once the
        # cursor has passed it (-1: none left). Searching both afresh for every event rescans the
        # rest of the chunk each time: quadratic in a 60 KB burst of 256 events (engines at full speed).
        lf = crlf = -2
        while True:
            if lf != -1 and lf < cursor:
                lf = data.find(b"\n\n", cursor, end)
            if crlf != -1 and crlf < cursor:
                crlf = data.find(b"\r\n\r\n", cursor, end)
            if crlf != -1 and (lf == -1 or crlf < lf):
                sep, length = crlf, 4
            elif lf != -1:
                sep, length = lf, 2
            else:
                break
            event_end = sep + length
            changed = self._event(data, cursor, sep, event_end)
            if self._strip and (
                self._held is not None
                or changed == b""
                or (any(data.find(m, cursor, sep) != -1 for m in _FINISH_MARKERS))
            ):
                if pieces is None:
                    pieces = [bytes(data[pos:cursor])]
                piece = changed if changed is not None else bytes(data[cursor:event_end])
                pieces.append(self._through_hold(piece, dropped=changed == b""))
            else:
                if changed is not None and pieces is None:
                    pieces = [bytes(data[pos:cursor])]
                if pieces is not None:
                    pieces.append(changed if changed is not None else bytes(data[cursor:event_end]))
            cursor = event_end
        return (b"".join(pieces) if pieces is not None else None), cursor

    def _event(self, data: bytes | bytearray, start: int, body_end: int, event_end: int) -> bytes | None:
        """Scan one event data[start:event_end] (body up to body_end); return its stripped form or None if unchanged."""
        members: list[_Member] = []
        first = data.find(_USAGE_KEY, start, body_end)
        if (
            first > start
            and first == body_end - _NULL_TAIL_LEN + 1
            and data.startswith(_NULL_TAIL, first - 1)
        ):
            # The usual content chunk under injection (vLLM, SGLang): `..., "usage":null}` as
            # its only usage member, last. Same result as the general path below, minus its
            # per-event allocations: this runs for every token of every stream.
            self._note_side_markers(data, start, body_end)
            if self._strip and self._strip_null:
                return b"".join((data[start : first - 1], data[body_end - 1 : event_end]))
            return None
        if first != -1:
            members = _find_usage_members(data, start, body_end)
        if not any(m.is_object for m in members):
            self._note_side_markers(data, start, body_end)
            if self._strip and self._strip_null and members:
                return _without_members(data, start, event_end, members)
            return None
        self._apply_deferred()
        event = bytes(data[start:body_end])
        decode_count.value += 1
        try:
            decoded = orjson.loads(_data_payload(event))
        except (orjson.JSONDecodeError, TypeError, ValueError):
            decoded = None
        if isinstance(decoded, dict):
            self._usage = self._usage.merged(_usage_from_object(decoded))
            self._saw_usage = True
        if not self._strip:
            return None
        if _is_usage_only(data, start, body_end):
            self._dropped_usage = event
            return b""
        removable = [m for m in members if m.is_object or self._strip_null]
        return _without_members(data, start, event_end, removable)

    def _note_side_markers(self, data: bytes | bytearray, start: int, body_end: int) -> None:
        """Keep the event for a lazy decode if it carries one of the engines' metrics blocks."""
        for marker in _SIDE_MARKERS:
            if data.find(marker, start, body_end) != -1:
                # Cumulative blocks (SGLang /generate meta_info, mindnano_metrics)
                # ride on every event: keep the latest, decode once when asked.
                self._deferred = bytes(data[start:body_end])
                return

    def _apply_deferred(self) -> None:
        """Decode the latest side-marker event, if one is waiting."""
        if self._deferred is None:
            return
        event, self._deferred = self._deferred, None
        decode_count.value += 1
        try:
            decoded = orjson.loads(_data_payload(event))
        except (orjson.JSONDecodeError, TypeError, ValueError):
            return
        if isinstance(decoded, dict):
            self._usage = self._usage.merged(_usage_from_object(decoded))
            self._saw_usage = True


@dataclass(frozen=True)
class Observation:
    """What the sidecar saw of one forwarded inference request (no prompt, text, key or user)."""

    request_id: str
    session_id: str | None
    case_id: str | None
    method: str
    path: str
    status: int | None
    stream: bool
    model: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    cached_tokens_source: str | None
    reset_id: str | None
    ordinal_since_reset: int | None
    started_ns: int
    first_byte_ns: int | None
    finished_ns: int
    outcome: str  # "ok" | "client_disconnected" | "upstream_error" | "timeout"
    usage_injected: bool

    def to_record(self) -> dict[str, Any]:
        """The `infer.cache_observation` evidence record (SPEC §5.2)."""
        return {
            "schema_version": 1,
            "event_type": "infer.cache_observation",
            "at_ns": self.finished_ns,
            "request_id": self.request_id,
            "session_id": self.session_id,
            "case_id": self.case_id,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "stream": self.stream,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_tokens_source": self.cached_tokens_source,
            "reset_id": self.reset_id,
            "ordinal_since_reset": self.ordinal_since_reset,
            "started_ns": self.started_ns,
            "first_byte_ns": self.first_byte_ns,
            "finished_ns": self.finished_ns,
            "outcome": self.outcome,
            "usage_injected": self.usage_injected,
        }
