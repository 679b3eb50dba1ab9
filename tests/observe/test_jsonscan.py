"""The request body's top-level members: the string-skipping scanner against a reference.

`top_level_members` skips strings with `bytes.find` (issue 34: a character class in `re` walked
a 220 KB prompt a byte at a time, 3.1 ms). The reference below is the regex scanner it
replaced; on any bytes, valid JSON or not, both must find the same members and the same close.
"""

from __future__ import annotations

import re

import orjson
from hypothesis import example, given
from hypothesis import strategies as st

from proxy.observe.jsonscan import Member, TopLevel, skip_ws, top_level_members, value_end

KEYS = frozenset({b'"stream"', b'"model"', b'"stream_options"'})
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]]', re.DOTALL)


def reference(data: bytes, keys: frozenset[bytes]) -> TopLevel | None:
    """The regex scanner before issue 34, as it was."""
    end = len(data)
    start = skip_ws(data, 0, end)
    if start >= end or data[start] != 0x7B:
        return None
    longest = max(len(key) for key in keys)
    depth, close = 0, -1
    starts: dict[bytes, tuple[int, int]] = {}
    for token in _TOKENS.finditer(data, start):
        first = data[token.start()]
        if first == 0x22:
            if depth == 1 and token.end() - token.start() <= longest:
                after = skip_ws(data, token.end(), end)
                key = bytes(data[token.start() : token.end()])
                if key in keys and after < end and data[after] == 0x3A:
                    starts[key] = (token.start(), skip_ws(data, after + 1, end))
            continue
        depth += 1 if first in b"{[" else -1
        if depth == 0:
            close = token.start()
            break
    if close == -1 or skip_ws(data, close + 1, end) != end:
        return None
    members: dict[bytes, Member] = {}
    for key, (key_start, value_start) in starts.items():
        stop = value_end(data, value_start, close)
        if stop == -1 or stop == value_start:
            return None
        members[key] = Member(key_start, value_start, stop, data[value_start] == 0x7B)
    return TopLevel(members, close)


# Pieces that make the scanner's decisions: quotes, escapes, brackets, the keys it looks for.
PIECES = st.sampled_from(
    [
        *('"', "\\", '\\"', "\\\\", "{", "}", "[", "]", ":", ",", " ", "x", "true", "null", "1"),
        *('"stream"', '"model"', '"stream_options"', '"stream":', '"model":"m"', '{"include_usage":1}'),
    ]
)
JUNK = st.lists(PIECES, max_size=40).map(lambda parts: "{" + "".join(parts)).map(str.encode)
VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(alphabet='ab"\\{}[]:, é\n', max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["stream", "x", "model"]), inner)
    ),
    max_leaves=12,
)
OBJECTS = st.dictionaries(
    st.sampled_from(["stream", "model", "stream_options", "messages", "n"]), VALUES
).map(orjson.dumps)


@given(st.one_of(JUNK, OBJECTS))
@example(b'{"a":"x}')  # an unterminated string: its quote is no token, the brace after it counts
@example(b'{"stream":true,"model":"a\\"b","x":"\\\\"}')
@example(b'{"x":"\\\\\\"}"}')
@example(b'{"messages":[{"content":"' + b"word " * 5000 + b'"}],"stream":true}')
def test_members_as_the_regex_scanner_found_them(data: bytes) -> None:
    """Same members, same spans, same close, on JSON and on junk alike (`ambiguous`, which the
    reference did not know, is tested in test_parser_differential.py)."""
    assert found(top_level_members(data, KEYS)) == found(reference(data, KEYS))
    assert found(top_level_members(bytearray(data), KEYS)) == found(reference(data, KEYS))


def found(top: TopLevel | None) -> tuple[dict[bytes, Member], int] | None:
    """What both scanners report: the members and the close."""
    return None if top is None else (top.members, top.close)
