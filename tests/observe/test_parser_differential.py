"""No injection into a body the engine's parser may read otherwise than the sidecar (issue 45).

The sidecar reads raw member names; vLLM and SGLang read bodies with Python's json, which
decodes `"str\\u0065am"` to `stream`, keeps the last of two equal names, and takes NaN,
Infinity, 1e400 and lone surrogates that orjson refuses. Where any of that could change which
`stream` the engine reads, nothing is injected; wherever something is injected, Python's json
and a first-wins parser both read a stream with `include_usage` on.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from proxy.observe import prepare_request
from proxy.observe.jsonscan import top_level_members

KEYS = frozenset({b'"stream"', b'"model"', b'"stream_options"'})
PAD = b" " * (16 * 1024 + 1)  # past the whole-decode size: the scanner alone reads the body


@pytest.mark.parametrize(
    ("body", "ambiguous"),
    [
        (b'{"model":"m","stream":true,"messages":[]}', False),
        (b'{"stream":true,"str\\u0065am":false}', True),
        (b'{"stream":false,"stream":true}', True),
        (b'{"stream":true,"stream\\u005foptions":null}', True),
        (b'{"model":"m","\\u0078":1,"stream":true}', True),  # any escaped name: it may decode to one of ours
        (b'{"stream":true,"' + b"x" * 300 + b'":1}', True),  # too long to keep: not compared
        # Nested names, escaped values and a name quoted in a string do not count.
        (b'{"a":{"b":1,"b":2},"m":"\\u0041","c":[{"stream":1},{"stream":2}],"stream":true}', False),
        (b'{"content":"\\"stream\\": 1, \\"stream\\": 2","stream":true}', False),
    ],
)
def test_the_scanner_marks_names_a_parser_may_read_otherwise(body: bytes, ambiguous: bool) -> None:
    top = top_level_members(body, KEYS)
    assert top is not None and top.ambiguous is ambiguous


# Issue 45's body: a stream to the raw names, not a stream to Python's json.
ATTACK = b'{"model":"m","messages":[],"stream":true,"str\\u0065am":false,"x":NaN}'


@pytest.mark.parametrize(
    "body",
    [
        ATTACK,
        ATTACK + PAD,
        b'{"stream":true,"str\\u0065am":false}' + PAD,  # orjson takes it small; the scanner reads it large
        b'{"stream":false,"stream":true}',
        b'{"stream":false,"stream":true}' + PAD,
        b'{"stream":true,"stream_options":{},"stream\\u005foptions":{"include_usage":false}}' + PAD,
        # orjson refuses these; Python's json takes them: small bodies are not injected.
        b'{"stream":true,"temperature":NaN}',
        b'{"stream":true,"temperature":Infinity}',
        b'{"stream":true,"temperature":-Infinity}',
        b'{"stream":true,"temperature":1e400}',
        b'{"stream":true,"messages":[{"content":"\\ud800"}]}',
    ],
)
def test_a_body_parsers_may_read_otherwise_is_never_injected(body: bytes) -> None:
    prepared = prepare_request(body, inject_usage=True)
    assert not prepared.usage_injected and prepared.upstream_body() == body


def _first_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object as a first-wins parser builds it."""
    return dict(reversed(pairs))


def _readings(body: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """The body as Python's json (last wins) and as a first-wins parser read it."""
    last, first = json.loads(body), json.loads(body, object_pairs_hook=_first_wins)
    assert isinstance(last, dict) and isinstance(first, dict)
    return last, first


# Spellings of the names that matter: plain, and with one character written as \uXXXX.
_NAMES = ["stream", "stream_options", "model", "messages", "temperature"]
_PLAIN = [json.dumps(n).encode() for n in _NAMES]
_ESCAPED = [
    b'"' + name[:i].encode() + f"\\u{ord(name[i]):04x}".encode() + name[i + 1 :].encode() + b'"'
    for name in _NAMES
    for i in (0, 3)
]
_VALUES = [b"true", b"false", b"null", b"1", b'"m"', b"{}", b'{"include_usage":false}', b"[]"]
_VALUES += [b"NaN", b"Infinity", b"-Infinity", b"1e400", b'"\\ud800"', b'"\\u0041"']
_MEMBER = st.tuples(st.sampled_from(_PLAIN) | st.sampled_from(_ESCAPED), st.sampled_from(_VALUES))


@given(
    members=st.lists(_MEMBER, max_size=5),
    at=st.integers(0, 5),
    padded=st.booleans(),
)
@example(members=[(b'"str\\u0065am"', b"false"), (b'"x"', b"NaN")], at=0, padded=False)
@example(members=[(b'"stream"', b"false")], at=1, padded=True)
@example(members=[(b'"model"', b'"m"')], at=1, padded=True)
def test_whatever_is_injected_every_parser_reads_as_a_stream_with_usage(
    members: list[tuple[bytes, bytes]], at: int, padded: bool
) -> None:
    """Python's json and a first-wins parser agree with the injection wherever it is made."""
    members.insert(at, (b'"stream"', b"true"))
    body = b"{" + b",".join(name + b":" + value for name, value in members) + b"}" + (PAD if padded else b"")
    prepared = prepare_request(body, inject_usage=True)
    if not prepared.usage_injected:
        return
    last, first = _readings(body)
    assert last.get("stream") is True and first.get("stream") is True
    sent_last, sent_first = _readings(prepared.upstream_body())
    for sent in (sent_last, sent_first):
        assert sent["stream"] is True and sent["stream_options"]["include_usage"] is True
        assert {k: v for k, v in sent.items() if k != "stream_options"}.keys() == last.keys() - {
            "stream_options"
        }
