"""Property tests: through the scanner, a client gets the engine's answer to its own request.

Streams are generated in each engine's shape, twice from one draw: as the engine answers
the client's own request (`direct`) and as it answers the request with include_usage
injected (`injected`). The second, cut into random chunks and fed through the scanner
with that engine's rules, must come out as the first, byte for byte, and the usage read
must be the usage the engine put in. Streams the sidecar does not inject into must pass
through as they came, usage read all the same.

Layouts vary as the SSE spec allows: `\\n` or `\\r\\n` per line, comments between events
(also between the finish and the usage chunk), JSON spread over several `data:` lines,
compact or spaced JSON, and events up to 2 MiB. The example count comes from the
hypothesis profile (tests/conftest.py): `ci` runs 10,000 examples of each property.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from proxy.engines.base import EngineInfo
from proxy.observe import StreamScanner, Usage, rules_for
from proxy.vocabulary import EngineKind

ABSENT = object()


@dataclass(frozen=True)
class Shape:
    """How one engine writes a chat/completions stream, in the facts that matter to injection."""

    kind: EngineKind
    version: str | None
    null_usage: str  # "with_include_usage" | "always" | "never"
    last_event: tuple[tuple[str, Any], ...] = ()  # members on the stream's last event
    finish_extra: tuple[tuple[str, Any], ...] = ()  # members on the finish and the usage chunk


INJECTED_SHAPES = {
    "vllm": Shape(EngineKind.VLLM, "0.32.0", "never", last_event=(("system_fingerprint", "vllm-0.32.0"),)),
    "sglang-pydantic": Shape(EngineKind.SGLANG, "0.4.6", "always"),
    "sglang-msgspec": Shape(EngineKind.SGLANG, "0.5.10", "never"),
    "openai": Shape(
        EngineKind.GENERIC, None, "with_include_usage", last_event=(("system_fingerprint", "fp_1"),)
    ),
    "mindnano": Shape(
        EngineKind.MINDNANO,
        None,
        "with_include_usage",
        finish_extra=(("mindnano_metrics", {"cached_tokens": 3}),),
    ),
}

# Text that tries to look like what the scanner searches for, inside JSON strings.
TRICKY = st.sampled_from(
    ['"usage":null', '"usage":{"a":1}', "\\", '"', "}", "{", "data: x", "\n\n", "\r\n", "é", "🙂", ": ping"]
)
TEXT = st.lists(st.one_of(TRICKY, st.text(max_size=8)), max_size=4).map("".join)
# Most events are small; a few are over the 1 MiB framing bound.
BIG = st.one_of(st.just(0), st.just(0), st.just(0), st.just(0), st.integers(1 << 20, 2 << 20))


@dataclass(frozen=True)
class Layout:
    """How events are laid out on the wire."""

    pretty: bool  # `", "` and `": "` between JSON tokens
    endings: tuple[bytes, ...]  # line endings, cycled line by line (so mixed within an event too)
    space: bool  # `data: ` or `data:`
    breaks: tuple[int, ...]  # per event, cycled: break the data line after every n-th token (0: one line)
    comments: frozenset[int]  # a comment event goes before the event with this index


def tokens(value: Any, pretty: bool) -> list[str]:
    """The JSON text of value, as a list of tokens (each a piece a line may end after)."""
    if isinstance(value, dict):
        out = ["{"]
        for index, (key, item) in enumerate(value.items()):
            if index:
                out.append(", " if pretty else ",")
            out += [orjson.dumps(key).decode(), ": " if pretty else ":", *tokens(item, pretty)]
        return [*out, "}"]
    if isinstance(value, list):
        out = ["["]
        for index, item in enumerate(value):
            if index:
                out.append(", " if pretty else ",")
            out += tokens(item, pretty)
        return [*out, "]"]
    return [orjson.dumps(value).decode()]


def event(obj: dict[str, Any], base: int, index: int, layout: Layout, extra: dict[str, Any]) -> bytes:
    """One SSE event: obj's first `base` members may be spread over lines, `extra` members follow."""
    whole = {**obj, **extra}
    toks = tokens(whole, layout.pretty)
    # Tokens of the base members (after `{`): lines may break only there, so that a member
    # the injection adds or moves (always after them) never starts a line of its own.
    base_tokens = len(tokens(dict(list(obj.items())[:base]), layout.pretty)) - 1
    every = layout.breaks[index % len(layout.breaks)]
    prefix = b"data: " if layout.space else b"data:"
    lines, current = [], ""
    for position, token in enumerate(toks):
        current += token
        if every and position < base_tokens and position % every == every - 1:
            lines.append(current)
            current = ""
    lines.append(current)
    endings = [layout.endings[(index + k) % len(layout.endings)] for k in range(len(lines) + 1)]
    out = (
        b"".join(prefix + line.encode() + end for line, end in zip(lines, endings, strict=False))
        + endings[-1]
    )
    return comment(index, layout) + out


def comment(index: int, layout: Layout) -> bytes:
    """The comment event that goes before event `index`, if the layout has one there."""
    ending = layout.endings[index % len(layout.endings)]
    return b": ping" + ending + ending if index in layout.comments else b""


@dataclass(frozen=True)
class Draw:
    """One generated exchange."""

    chat: bool
    pieces: tuple[str, ...]
    finish_text: str
    big: int
    usage: tuple[int, int, int]
    layout: Layout


def render(shape: Shape, draw: Draw, *, include_usage: bool) -> bytes:
    """The engine's stream for this draw, with or without include_usage."""
    prompt, completion, cached = draw.usage
    null = shape.null_usage == "always" or (shape.null_usage == "with_include_usage" and include_usage)
    head: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk" if draw.chat else "text_completion",
        "created": 1,
        "model": "m",
    }

    def chunk(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if draw.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**head, "choices": [choice]}

    objects: list[tuple[dict[str, Any], dict[str, Any]]] = []
    nulls = {"usage": None} if null else {}
    if draw.chat:
        objects.append((chunk(None, None, first=True), dict(nulls)))
    pieces = list(draw.pieces)
    if draw.big:
        pieces.append("x" * draw.big)
    objects += [(chunk(piece, None), dict(nulls)) for piece in pieces]
    objects.append((chunk(draw.finish_text or None, "length"), {**nulls, **dict(shape.finish_extra)}))
    if include_usage:
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        objects.append(({**head, "choices": []}, {"usage": usage, **dict(shape.finish_extra)}))
    objects[-1][1].update(dict(shape.last_event))
    out = [event(obj, len(obj), index, draw.layout, extra) for index, (obj, extra) in enumerate(objects)]
    # The usage chunk takes the index [DONE] has without it: a comment placed before [DONE]
    # in the direct stream comes between the finish and the usage chunk in the injected one.
    done = len(objects) - 1 if include_usage else len(objects)
    ending = draw.layout.endings[done % len(draw.layout.endings)]
    last = b"" if include_usage else comment(done, draw.layout)
    return b"".join(out) + last + b"data: [DONE]" + ending + ending


layouts = st.builds(
    Layout,
    pretty=st.booleans(),
    endings=st.lists(st.sampled_from([b"\n", b"\r\n"]), min_size=1, max_size=4).map(tuple),
    space=st.booleans(),
    breaks=st.lists(st.sampled_from([0, 0, 0, 1, 2, 3, 7]), min_size=1, max_size=4).map(tuple),
    comments=st.frozensets(st.integers(0, 12), max_size=4),
)
draws = st.builds(
    Draw,
    chat=st.booleans(),
    pieces=st.lists(TEXT, max_size=6).map(tuple),
    finish_text=TEXT,
    big=BIG,
    usage=st.tuples(st.integers(0, 10**6), st.integers(0, 10**5), st.integers(0, 10**6)),
    layout=layouts,
)
# How the stream arrives: chunks of byte sizes, cycled (at most ~2,000 chunks per stream so
# that 2 MiB events stay quick), or reads of whole events, so many events per read, cycled
# (engines write whole events; a burst of them is one read, which the scanner answers with
# searches over the whole read).
Reads = tuple[str, list[int]]
splits = st.one_of(
    st.lists(st.integers(1, 64 * 1024), min_size=1, max_size=8).map(lambda sizes: ("bytes", sizes)),
    st.lists(st.integers(1, 12), min_size=1, max_size=8).map(lambda counts: ("events", counts)),
)
# Where an event ends: the first blank line, `\n\n` or `\n\r\n`, as the SSE spec frames them.
BLANK_LINE = re.compile(rb"\n\r?\n")


def cuts(data: bytes, reads: Reads) -> list[bytes]:
    """The stream as the reads deliver it."""
    mode, counts = reads
    if mode == "events":
        ends = [match.end() for match in BLANK_LINE.finditer(data)]
        if not ends or ends[-1] != len(data):
            ends.append(len(data))
        out: list[bytes] = []
        pos, index = 0, 0
        for count in itertools.cycle(counts):
            if index >= len(ends):
                return out
            index = min(index + count, len(ends))
            out.append(data[pos : ends[index - 1]])
            pos = ends[index - 1]
    floor = len(data) // 2000
    out, pos = [], 0
    for size in itertools.cycle(counts):
        if pos >= len(data):
            break
        step = max(size, floor)
        out.append(data[pos : pos + step])
        pos += step
    return out


def feed(scanner: StreamScanner, data: bytes, reads: Reads) -> bytes:
    """What the client gets when data arrives in these reads."""
    out = [scanner.feed(chunk) for chunk in cuts(data, reads)]
    out.append(scanner.finish())
    return b"".join(out)


@given(shape=st.sampled_from(sorted(INJECTED_SHAPES)), draw=draws, reads=splits)
def test_an_injected_stream_reaches_the_client_as_its_own_answer(
    shape: str, draw: Draw, reads: Reads
) -> None:
    engine = INJECTED_SHAPES[shape]
    direct = render(engine, draw, include_usage=False)
    injected = render(engine, draw, include_usage=True)
    scanner = StreamScanner(rules_for(EngineInfo(engine.kind, engine.version)))
    assert feed(scanner, injected, reads) == direct
    prompt, completion, cached = draw.usage
    assert scanner.usage == Usage(prompt, completion, cached, "usage.prompt_tokens_details.cached_tokens")
    assert scanner.engine_id == "chatcmpl-1"


# --- streams the sidecar does not inject into: they pass as they came -------------------


def llamacpp_stream(draw: Draw) -> tuple[bytes, Usage]:
    """llama.cpp chat: `timings` on the finish chunk (its last event without include_usage)."""
    prompt, completion, cached = draw.usage
    evaluated = max(prompt - cached, 0)
    timings = {"cache_n": cached, "prompt_n": evaluated, "predicted_n": completion, "predicted_ms": 1.5}
    head = {"id": "chatcmpl-l", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    pieces = [*draw.pieces, "x" * draw.big] if draw.big else list(draw.pieces)
    objects: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({**head, "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}, {})
        for p in pieces
    ]
    objects.append(
        ({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}, {"timings": timings})
    )
    body = b"".join(event(o, len(o), i, draw.layout, x) for i, (o, x) in enumerate(objects))
    ending = draw.layout.endings[0]
    return body + b"data: [DONE]" + ending + ending, Usage(
        evaluated + cached, completion, cached, "timings.cache_n"
    )


def named(kind: str, obj: dict[str, Any], index: int, layout: Layout) -> bytes:
    """An event with an `event:` line before its data (Responses and Messages streams)."""
    ending = layout.endings[index % len(layout.endings)]
    return b"event: " + kind.encode() + ending + event(obj, len(obj), index, layout, {})


def responses_stream(draw: Draw) -> tuple[bytes, Usage]:
    """/v1/responses: usage on `response.completed`, after the whole output (which may be large)."""
    prompt, completion, cached = draw.usage
    text = "".join(draw.pieces) + "x" * draw.big
    usage = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
    }
    events = [
        (
            "response.created",
            {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}},
        )
    ]
    events += [
        ("response.output_text.delta", {"type": "response.output_text.delta", "delta": p})
        for p in draw.pieces
    ]
    done = {"id": "resp_1", "output": [{"content": [{"type": "output_text", "text": text}]}], "usage": usage}
    events.append(("response.completed", {"type": "response.completed", "response": done}))
    body = b"".join(named(kind, obj, i, draw.layout) for i, (kind, obj) in enumerate(events))
    return body, Usage(prompt, completion, cached, "usage.input_tokens_details.cached_tokens")


def messages_stream(draw: Draw) -> tuple[bytes, Usage]:
    """/v1/messages: input counts on `message_start`, output count on `message_delta`."""
    prompt, completion, cached = draw.usage
    start = {
        "id": "msg_1",
        "usage": {"input_tokens": prompt, "cache_read_input_tokens": cached, "output_tokens": 1},
    }
    events = [("message_start", {"type": "message_start", "message": start})]
    events += [
        ("content_block_delta", {"type": "content_block_delta", "delta": {"text": p}}) for p in draw.pieces
    ]
    events.append(("message_delta", {"type": "message_delta", "usage": {"output_tokens": completion}}))
    events.append(("message_stop", {"type": "message_stop"}))
    body = b"".join(named(kind, obj, i, draw.layout) for i, (kind, obj) in enumerate(events))
    return body, Usage(prompt + cached, completion, cached, "usage.cache_read_input_tokens")


PASS_THROUGH = {"llamacpp": llamacpp_stream, "responses": responses_stream, "messages": messages_stream}


@given(kind=st.sampled_from(sorted(PASS_THROUGH)), draw=draws, reads=splits)
def test_a_stream_not_injected_into_passes_unchanged_and_its_usage_is_read(
    kind: str, draw: Draw, reads: Reads
) -> None:
    data, usage = PASS_THROUGH[kind](draw)
    scanner = StreamScanner()
    assert feed(scanner, data, reads) == data
    assert scanner.usage == usage


def test_pass_through_hands_back_the_same_chunk_objects() -> None:
    data, _ = llamacpp_stream(
        Draw(True, ("a", "b"), "", 0, (10, 2, 4), Layout(False, (b"\n",), True, (0,), frozenset()))
    )
    scanner = StreamScanner()
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]
    assert all(scanner.feed(chunk) is chunk for chunk in chunks)
