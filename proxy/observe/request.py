"""Which requests are observed, and the request body with `stream_options.include_usage` added."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.observe.jsonscan import Buffer, Member, top_level_members

__all__ = [
    "INJECTABLE_PATHS",
    "OBSERVED_PATHS",
    "PreparedRequest",
    "Splice",
    "is_observed",
    "names_stream_options",
    "prepare_request",
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


def is_observed(method: str, path: str) -> bool:
    """Whether a forwarded request is an inference request that gets an observation."""
    return method == "POST" and path in OBSERVED_PATHS


@dataclass(frozen=True)
class Splice:
    """Bytes that replace `body[start:end]` on the way upstream (the injected stream_options)."""

    start: int
    end: int
    insert: bytes


@dataclass(frozen=True)
class PreparedRequest:
    """The client's request body, what was learnt reading it, and the injection to send with it.

    The injection is kept as a splice, not a rewritten copy: a large body is held once, and
    sent upstream in pieces around the few inserted bytes.
    """

    body: Buffer
    stream: bool
    model: str | None
    injection: Splice | None = None

    @property
    def usage_injected(self) -> bool:
        """Whether `stream_options.include_usage` is added on the way upstream."""
        return self.injection is not None

    @property
    def upstream_size(self) -> int:
        """The length of the body the engine gets."""
        splice = self.injection
        if splice is None:
            return len(self.body)
        return len(self.body) - (splice.end - splice.start) + len(splice.insert)

    def upstream_pieces(self) -> tuple[Buffer | memoryview, ...]:
        """The body the engine gets, as pieces that share the client's buffer."""
        splice = self.injection
        if splice is None:
            return (self.body,)
        view = memoryview(self.body)
        return (view[: splice.start], splice.insert, view[splice.end :])

    def upstream_body(self) -> bytes:
        """The body the engine gets, as one new bytes object (a copy: for small bodies)."""
        if self.injection is None:
            return bytes(self.body)
        return b"".join(self.upstream_pieces())

    def without_injection(self) -> PreparedRequest:
        """The same request sent as the client wrote it (an engine refused the injection)."""
        return PreparedRequest(self.body, self.stream, self.model)


_STREAM, _MODEL, _OPTIONS = b'"stream"', b'"model"', b'"stream_options"'
_WANTED = frozenset({_STREAM, _MODEL, _OPTIONS})
_UNREADABLE = object()
# A body this small is decoded whole first: for a 120-byte chat request that costs 1.2 µs
# where the scanner costs 7.4 µs (timeit, issue 19). It settles every request but a stream
# that would get the injection: that one is read by the scanner too, which alone sees how the
# member names were written (escaped, repeated) and where the injection goes.
_DECODE_WHOLE = 16 * 1024


def _member_value(body: Buffer, member: Member | None) -> Any:
    """One small member's decoded value (None when absent, _UNREADABLE when it is not JSON)."""
    if member is None:
        return None
    try:
        return orjson.loads(bytes(body[member.value_start : member.value_end]))
    except orjson.JSONDecodeError:
        return _UNREADABLE


def _decoded_whole(body: Buffer, *, injectable: bool) -> PreparedRequest | None:
    """A small request read by decoding it; None when the scanner must decide (a stream to inject).

    A later duplicate member wins here as in the scanner, and as in Python's json.
    """
    decoded = orjson.loads(body)
    if not isinstance(decoded, dict):
        return PreparedRequest(body=body, stream=False, model=None)
    model = decoded.get("model")
    model = model if isinstance(model, str) else None
    stream = decoded.get("stream") is True
    if injectable and stream:
        return None
    return PreparedRequest(body=body, stream=stream, model=model)


def prepare_request(body: Buffer, *, inject_usage: bool, path: str | None = None) -> PreparedRequest:
    """Read `stream`/`model` and add `stream_options.include_usage` when allowed; never raises.

    Only the top-level members named above are decoded: the body itself (a prompt of tens of
    MiB) is neither parsed into objects nor copied. `path`, when given, limits injection to
    `INJECTABLE_PATHS`; None means the caller has already decided the route takes `stream_options`.
    """
    injectable = inject_usage and (path is None or path in INJECTABLE_PATHS)
    if len(body) <= _DECODE_WHOLE:
        try:
            small = _decoded_whole(body, injectable=injectable)
        except orjson.JSONDecodeError:
            # NaN, Infinity, 1e400, a lone surrogate: refused by orjson, taken by Python's json
            # (vLLM's and SGLang's parser). Parsers disagree on such a body: read, never injected.
            return _scanned(body, injectable=False)
        if small is not None:
            return small
    return _scanned(body, injectable=injectable)


def _scanned(body: Buffer, *, injectable: bool) -> PreparedRequest:
    """The body read by the scanner, with the injection when `injectable` and the names are plain."""
    top = top_level_members(body, _WANTED)
    if top is None:
        return PreparedRequest(body=body, stream=False, model=None)
    model = _member_value(body, top.members.get(_MODEL))
    stream = _member_value(body, top.members.get(_STREAM)) is True
    unchanged = PreparedRequest(body=body, stream=stream, model=model if isinstance(model, str) else None)
    # vLLM answers 400 to stream_options when stream is false: only touch streams, and only
    # those every parser reads alike (an escaped or repeated name may hide another `stream`).
    if not (injectable and stream) or top.ambiguous:
        return unchanged
    member = top.members.get(_OPTIONS)
    options = _member_value(body, member)
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        return unchanged  # malformed: let the engine answer the client's own mistake
    if options.get("include_usage") is True:
        return unchanged  # the client asked for usage itself and must get it
    value = orjson.dumps({**options, "include_usage": True})
    if member is not None:
        splice = Splice(member.value_start, member.value_end, value)
    else:
        # Appended as the last member; the object has members (`stream` is one), so a comma.
        splice = Splice(top.close, top.close, b',"stream_options":' + value)
    return PreparedRequest(body=body, stream=stream, model=unchanged.model, injection=splice)


def names_stream_options(error_body: bytes) -> bool:
    """Whether an engine's error answer is about `stream_options` (so about our injection)."""
    return b"stream_options" in error_body
