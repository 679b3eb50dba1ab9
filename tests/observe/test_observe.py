"""Cached-token extraction, include_usage injection and byte-exact stripping (proxy/observe/)."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.engines.base import EngineInfo
from proxy.observe import (
    MAX_EVENT_BYTES,
    JsonBody,
    Observation,
    StreamRules,
    StreamScanner,
    Usage,
    decode_count,
    is_observed,
    prepare_request,
    usage_from_json,
)
from proxy.observe.json_body import KEEP_BYTES
from proxy.observe.rules import InjectionRefusals, RuleEntry, rules_for
from proxy.vocabulary import EngineKind, Outcome

# --- streams as the engines write them -------------------------------------------


def openai_chat_stream(*, include_usage: bool, pretty: bool = False, crlf: bool = False) -> bytes:
    """OpenAI/vLLM-shaped chat stream; with include_usage every chunk gets `"usage":null`
    and one `choices: []` usage chunk comes before [DONE] (ENGINES.md, OpenAI semantics)."""
    sep = b"\r\n\r\n" if crlf else b"\n\n"
    colon = b": " if pretty else b":"
    comma = b", " if pretty else b","
    null_usage = comma + b'"usage"' + colon + b"null" if include_usage else b""
    events = []
    for delta, finish in (
        (b'{"role":"assistant","content":""}', b"null"),
        (b'{"content":"Hel"}', b"null"),
        (b'{"content":"lo \\"usage\\": not a key"}', b"null"),
        (b"{}", b'"stop"'),
    ):
        events.append(
            b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":'
            + delta
            + b',"logprobs":null,"finish_reason":'
            + finish
            + b"}]"
            + null_usage
            + b"}"
            + sep
        )
    if include_usage:
        events.append(
            b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[],"usage"' + colon + b'{"prompt_tokens":150,"total_tokens":153,'
            b'"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":128}}}' + sep
        )
    events.append(b"data: [DONE]" + sep)
    return b"".join(events)


def llamacpp_completions_stream(*, include_usage: bool) -> bytes:
    """llama.cpp /v1/completions: nlohmann sorted keys; include_usage puts `usage`
    on the finish chunk, after `timings` (ENGINES.md)."""
    events = [
        b'data: {"choices":[{"finish_reason":null,"index":0,"logprobs":null,"text":"ab"}],'
        b'"created":1,"id":"cmpl-1","model":"m","object":"text_completion","system_fingerprint":"b1"}\n\n'
    ]
    usage = (
        b',"usage":{"completion_tokens":2,"prompt_tokens":293,"prompt_tokens_details":{"cached_tokens":292},'
        b'"total_tokens":295}'
        if include_usage
        else b""
    )
    events.append(
        b'data: {"choices":[{"finish_reason":"length","index":0,"logprobs":null,"text":""}],'
        b'"created":1,"id":"cmpl-1","model":"m","object":"text_completion","system_fingerprint":"b1",'
        b'"timings":{"cache_n":292,"predicted_n":2,"prompt_n":1}' + usage + b"}\n\n"
    )
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


LLAMACPP_TIMINGS = b',"timings":{"cache_n":7,"predicted_n":2,"prompt_n":1}'


def vllm_chat_stream(*, include_usage: bool) -> bytes:
    """vLLM 0.32 /v1/chat/completions as captured from the real engine here: no `"usage":null`
    members, and `system_fingerprint` on the LAST event (the usage chunk once include_usage is on)."""
    fingerprint = b',"system_fingerprint":"vllm-0.32.0-a7049512"'
    head = (
        b'data: {"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,'
        b'"delta":{"content":"~"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
    )
    finish = (
        b'data: {"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,'
        b'"delta":{"content":""},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null}]'
        + (b"" if include_usage else fingerprint)
        + b"}\n\n"
    )
    usage = (
        b'data: {"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[],'
        b'"usage":{"prompt_tokens":30,"total_tokens":33,"completion_tokens":3,"prompt_tokens_details":'
        b'{"cached_tokens":16,"created_cache_tokens":0}}' + fingerprint + b"}\n\n"
        if include_usage
        else b""
    )
    return head + finish + usage + b"data: [DONE]\n\n"


def llamacpp_chat_stream(*, include_usage: bool) -> bytes:
    """llama.cpp /v1/chat/completions: `timings` rides on the LAST event (tools/server pushes it
    onto `deltas.back()`, after `usage`), which with include_usage is the `choices: []` usage chunk."""
    head = b'data: {"choices":[{"delta":{"content":"ab"},"finish_reason":null,"index":0}],"created":1,"id":"c","model":"m","object":"chat.completion.chunk","system_fingerprint":"b1"}\n\n'
    finish = (
        b'data: {"choices":[{"delta":{},"finish_reason":"length","index":0}],"created":1,"id":"c",'
        b'"model":"m","object":"chat.completion.chunk","system_fingerprint":"b1"'
        + (b"" if include_usage else LLAMACPP_TIMINGS)
        + b"}\n\n"
    )
    usage = (
        b'data: {"choices":[],"created":1,"id":"c","model":"m","object":"chat.completion.chunk",'
        b'"system_fingerprint":"b1","usage":{"completion_tokens":2,"prompt_tokens":8,'
        b'"total_tokens":10}' + LLAMACPP_TIMINGS + b"}\n\n"
        if include_usage
        else b""
    )
    return head + finish + usage + b"data: [DONE]\n\n"


def run(scanner: StreamScanner, chunks: list[bytes]) -> bytes:
    """Feed chunks and collect what the client would receive."""
    return b"".join(scanner.feed(c) for c in chunks) + scanner.finish()


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    """data cut at the given offsets."""
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


# --- routes -------------------------------------------------------------------------


def test_only_post_to_inference_routes_is_observed() -> None:
    assert is_observed("POST", "/v1/chat/completions")
    assert is_observed("POST", "/generate")
    assert not is_observed("GET", "/v1/chat/completions")
    assert not is_observed("POST", "/v1/models")


_APPENDED = b',"stream_options":{"include_usage":true}'

# --- prepare_request ----------------------------------------------------------------


def test_non_stream_body_is_untouched_byte_for_byte() -> None:
    body = b'{ "model": "m",  "stream": false, "messages": [] }'
    prepared = prepare_request(body, inject_usage=True)
    assert prepared.body is body
    assert (prepared.stream, prepared.model, prepared.usage_injected) == (False, "m", False)


def test_stream_body_gets_include_usage() -> None:
    prepared = prepare_request(b'{"model":"m","stream":true,"messages":[]}', inject_usage=True)
    assert prepared.usage_injected and prepared.stream
    assert orjson.loads(prepared.upstream_body())["stream_options"] == {"include_usage": True}


def test_include_usage_already_true_is_not_injected() -> None:
    body = b'{"stream":true,"stream_options":{"include_usage":true}}'
    prepared = prepare_request(body, inject_usage=True)
    assert prepared.body is body and not prepared.usage_injected


def test_other_stream_options_members_are_kept() -> None:
    body = b'{"stream":true,"stream_options":{"continuous_usage_stats":false,"include_usage":false}}'
    prepared = prepare_request(body, inject_usage=True)
    assert orjson.loads(prepared.upstream_body())["stream_options"] == {
        "continuous_usage_stats": False,
        "include_usage": True,
    }


def test_invalid_json_is_untouched() -> None:
    for body in (b"{not json", b"[1,2]", b"", b"\xff\xfe"):
        prepared = prepare_request(body, inject_usage=True)
        assert prepared == type(prepared)(body=body, stream=False, model=None)


def test_injection_keeps_the_clients_bytes_around_it() -> None:
    """The body is spliced, not re-serialised: the client's formatting reaches the engine."""
    body = b'{ "model": "m", "stream": true,\n  "stream_options": null, "messages": [] }\n'
    prepared = prepare_request(body, inject_usage=True)
    assert prepared.upstream_body() == body.replace(b"null", b'{"include_usage":true}')
    assert prepared.upstream_size == len(prepared.upstream_body()) and prepared.body is body
    appended = prepare_request(b'{"stream":true,"m":[{"stream":false}]}', inject_usage=True)
    assert (
        appended.upstream_body()
        == b'{"stream":true,"m":[{"stream":false}],"stream_options":{"include_usage":true}}'
    )


def test_a_small_stream_gets_the_member_before_its_closing_brace() -> None:
    """Decoded whole, the injection goes before the brace, whatever whitespace follows it."""
    for tail in (b"", b"\n", b" \t\r\n  "):
        body = b'{"model":"m","stream":true,"messages":[{"content":"}"}]}' + tail
        prepared = prepare_request(body, inject_usage=True)
        assert prepared.upstream_body() == body[: body.rindex(b"}")] + _APPENDED + b"}" + tail


_SCANNED = 16 * 1024 + 1  # past prepare_request's whole-decode size: the scanner reads it


@settings(max_examples=300)
@given(
    members=st.lists(
        st.tuples(
            st.sampled_from(["stream", "model", "messages", "stream_options", "max_tokens"]),
            st.recursive(
                st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
                lambda inner: (
                    st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
                ),
                max_leaves=6,
            ),
        ),
        max_size=6,
    ),
    inject=st.booleans(),
)
@example(members=[("stream", True), ("model", "m")], inject=True)
@example(members=[("stream", True), ("stream", False), ("model", "a"), ("model", 1)], inject=True)
@example(members=[("stream", False), ("stream", True)], inject=False)
def test_a_small_body_decoded_whole_reads_as_the_scanner_reads_it(
    members: list[tuple[str, object]], inject: bool
) -> None:
    """The whole-decode shortcut for small bodies agrees with the scanner (duplicates included)."""
    body = b"{" + b",".join(orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in members) + b"}"
    small = prepare_request(body, inject_usage=inject)
    scanned = prepare_request(body + b" " * _SCANNED, inject_usage=inject)
    assert (small.stream, small.model, small.usage_injected) == (
        scanned.stream,
        scanned.model,
        scanned.usage_injected,
    )
    if small.injection is not None:
        assert small.upstream_body() + b" " * _SCANNED == scanned.upstream_body()


def test_only_top_level_members_count() -> None:
    """`stream` inside a message or a tool schema is not the request's; a later duplicate wins,
    and a body with one is not injected (a first-wins parser reads the other `stream`)."""
    nested = b'{"model":"m","tools":[{"parameters":{"stream":true,"model":"x"}}],"messages":[]}'
    assert (
        prepare_request(nested, inject_usage=True).stream,
        prepare_request(nested, inject_usage=True).model,
    ) == (False, "m")
    duplicate = prepare_request(b'{"stream":false,"stream":true}', inject_usage=True)
    assert duplicate.stream and not duplicate.usage_injected
    quoted = b'{"messages":[{"content":"say \\"stream\\": true }"}],"stream":false}'
    assert not prepare_request(quoted, inject_usage=True).stream


def test_a_large_body_is_read_without_decoding_it() -> None:
    """A 32 MiB prompt: stream and model found, the injection a splice (the body is not copied)."""
    body = bytearray(
        b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * (32 << 20) + b'"}],"stream":true}'
    )
    prepared = prepare_request(body, inject_usage=True)
    assert (prepared.stream, prepared.model, prepared.usage_injected) == (True, "m", True)
    assert prepared.body is body and prepared.upstream_size == len(body) + len(
        b',"stream_options":{"include_usage":true}'
    )


def test_injection_switched_off_leaves_stream_untouched() -> None:
    body = b'{"stream":true}'
    assert prepare_request(body, inject_usage=False).body is body


def test_native_and_event_routes_are_not_injected() -> None:
    body = b'{"stream":true,"text":"x"}'
    for path in ("/generate", "/completion", "/v1/responses", "/v1/messages"):
        assert not prepare_request(body, inject_usage=True, path=path).usage_injected
    assert prepare_request(body, inject_usage=True, path="/v1/completions").usage_injected


# --- usage_from_json: each dialect's field, and the order -------------------------


@pytest.mark.parametrize(
    ("body", "cached", "source", "prompt"),
    [
        (
            {
                "usage": {
                    "prompt_tokens": 150,
                    "completion_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": 128},
                }
            },
            128,
            "usage.prompt_tokens_details.cached_tokens",
            150,
        ),
        (
            {
                "usage": {
                    "input_tokens": 40,
                    "output_tokens": 2,
                    "input_tokens_details": {"cached_tokens": 32},
                }
            },
            32,
            "usage.input_tokens_details.cached_tokens",
            40,
        ),
        (
            {"timings": {"cache_n": 292, "prompt_n": 1, "predicted_n": 4}, "tokens_cached": 297},
            292,
            "timings.cache_n",
            293,
        ),
        (
            {"meta_info": {"prompt_tokens": 20, "cached_tokens": 16, "completion_tokens": 2}},
            16,
            "meta_info.cached_tokens",
            20,
        ),
        (
            {"usage": {"prompt_tokens": 9}, "mindnano_metrics": {"cached_tokens": 8}},
            8,
            "mindnano_metrics.cached_tokens",
            9,
        ),
        (
            {"usage": {"input_tokens": 1, "cache_read_input_tokens": 292, "output_tokens": 2}},
            292,
            "usage.cache_read_input_tokens",
            293,
        ),
    ],
)
def test_each_dialect_cached_field_is_read(
    body: dict[str, Any], cached: int, source: str, prompt: int
) -> None:
    usage = usage_from_json(orjson.dumps(body))
    assert (usage.cached_tokens, usage.cached_tokens_source, usage.prompt_tokens) == (cached, source, prompt)


def test_prompt_tokens_details_wins_over_timings() -> None:
    body = {"usage": {"prompt_tokens_details": {"cached_tokens": 5}}, "timings": {"cache_n": 6}}
    assert (
        usage_from_json(orjson.dumps(body)).cached_tokens_source
        == "usage.prompt_tokens_details.cached_tokens"
    )


def test_timings_win_over_meta_info_and_mindnano() -> None:
    body = {
        "timings": {"cache_n": 1},
        "meta_info": {"cached_tokens": 2},
        "mindnano_metrics": {"cached_tokens": 3},
    }
    assert usage_from_json(orjson.dumps(body)).cached_tokens == 1


def test_missing_cached_field_is_null_not_zero() -> None:
    usage = usage_from_json(b'{"usage":{"prompt_tokens":12,"completion_tokens":3}}')
    assert usage == Usage(
        prompt_tokens=12, completion_tokens=3, cached_tokens=None, cached_tokens_source=None
    )


def test_llamacpp_tokens_cached_is_not_a_hit_count() -> None:
    assert usage_from_json(b'{"content":"x","tokens_cached":297}').cached_tokens is None


def test_unparseable_response_gives_unknown_usage() -> None:
    assert usage_from_json(b"<html>502</html>") == Usage()


# --- StreamScanner: pass-through --------------------------------------------------


def test_pass_through_returns_each_chunk_object_unchanged() -> None:
    data = openai_chat_stream(include_usage=True)
    scanner = StreamScanner()
    for chunk in split_at(data, [7, 100, 101, 300]):
        assert scanner.feed(chunk) is chunk
    assert scanner.finish() == b""
    assert scanner.usage.cached_tokens == 128 and scanner.saw_usage


def test_pass_through_reads_usage_split_at_every_byte() -> None:
    data = openai_chat_stream(include_usage=True, crlf=True)
    for cut in range(1, len(data)):
        scanner = StreamScanner()
        run(scanner, split_at(data, [cut]))
        assert scanner.usage.cached_tokens == 128, cut


# --- StreamScanner: stripping, byte for byte -------------------------------------

STRIP_CASES = {
    "openai_compact": (openai_chat_stream(include_usage=True), openai_chat_stream(include_usage=False), 128),
    "openai_pretty_crlf": (
        openai_chat_stream(include_usage=True, pretty=True, crlf=True),
        openai_chat_stream(include_usage=False, pretty=True, crlf=True),
        128,
    ),
    "vllm_last_event_fingerprint": (
        vllm_chat_stream(include_usage=True),
        vllm_chat_stream(include_usage=False),
        16,
    ),
    "llamacpp_chat_last_event_timings": (
        llamacpp_chat_stream(include_usage=True),
        llamacpp_chat_stream(include_usage=False),
        7,
    ),
    "llamacpp_completions": (
        llamacpp_completions_stream(include_usage=True),
        llamacpp_completions_stream(include_usage=False),
        292,
    ),
}


@pytest.mark.parametrize("case", sorted(STRIP_CASES))
def test_stripped_stream_equals_direct_stream_split_at_every_byte(case: str) -> None:
    injected, direct, cached = STRIP_CASES[case]
    for cut in range(1, len(injected)):
        scanner = StreamScanner(StreamRules())
        assert run(scanner, split_at(injected, [cut])) == direct, cut
        assert scanner.usage.cached_tokens == cached


@pytest.mark.parametrize("case", sorted(STRIP_CASES))
def test_stripped_stream_equals_direct_stream_in_random_splits(case: str) -> None:
    injected, direct, _ = STRIP_CASES[case]
    rng = random.Random(5)
    for _ in range(300):
        cuts = rng.sample(range(1, len(injected)), rng.randint(1, 40))
        assert run(StreamScanner(StreamRules()), split_at(injected, cuts)) == direct, cuts


def whole_events(stream: bytes) -> list[bytes]:
    """The stream as an engine at decode speed delivers it: each read one whole event."""
    blank = b"\r\n\r\n" if b"\r\n\r\n" in stream else b"\n\n"
    return [event + blank for event in stream.split(blank) if event]


@pytest.mark.parametrize("case", sorted(STRIP_CASES))
def test_stripped_stream_equals_direct_stream_one_event_per_read(case: str) -> None:
    """The reads a paced stream makes: the finish chunk must still be held for what moves back onto it."""
    injected, direct, cached = STRIP_CASES[case]
    scanner = StreamScanner(StreamRules())
    assert run(scanner, whole_events(injected)) == direct
    assert scanner.usage.cached_tokens == cached


def test_a_finish_reason_whose_value_is_on_a_later_data_line_is_still_held() -> None:
    """An event's JSON over several `data:` lines, one event per read: the finish chunk's value
    follows its key on a later line, and the fingerprint must still move back onto it
    (found by tests/observe/test_properties.py's ci profile)."""
    injected, direct, _ = STRIP_CASES["vllm_last_event_fingerprint"]

    def spread(event: bytes) -> bytes:
        # Every member on a line of its own: `"finish_reason"` and `:"length"` apart.
        body = event.removeprefix(b"data: ").removesuffix(b"\n\n")
        return (
            b"data:"
            + body.replace(b":", b"\ndata::", 1).replace(b'"finish_reason":', b'"finish_reason"\ndata::')
            + b"\n\n"
        )

    spread_injected = [spread(e) if e.startswith(b"data: {") else e for e in whole_events(injected)]
    spread_direct = b"".join(spread(e) if e.startswith(b"data: {") else e for e in whole_events(direct))
    assert b'"finish_reason"\ndata::' in b"".join(spread_injected)
    assert run(StreamScanner(StreamRules()), spread_injected) == spread_direct


@pytest.mark.parametrize("case", sorted(STRIP_CASES))
def test_passed_through_stream_one_event_per_read_reads_its_usage(case: str) -> None:
    injected, _, cached = STRIP_CASES[case]
    scanner = StreamScanner()
    assert run(scanner, whole_events(injected)) == injected
    assert scanner.usage.cached_tokens == cached


def test_stripped_stream_fed_one_byte_at_a_time() -> None:
    injected, direct, _ = STRIP_CASES["openai_pretty_crlf"]
    chunks = [injected[i : i + 1] for i in range(len(injected))]
    assert run(StreamScanner(StreamRules()), chunks) == direct


def test_complete_events_are_not_held_back() -> None:
    injected = openai_chat_stream(include_usage=True)
    first_end = injected.index(b"\n\n") + 2
    scanner = StreamScanner(StreamRules())
    out = scanner.feed(injected[: first_end + 10])
    assert out == openai_chat_stream(include_usage=False)[: out.__len__()]
    assert out.endswith(b"\n\n") and len(out) == first_end - len(b',"usage":null')


@pytest.mark.parametrize(
    "odd",
    [
        b': ping,"usage":null}\n\n',  # a comment is not a data event
        b'data: {"id":"chatcmpl-1","choices":[]}\nid: 7,"usage":null}\n\n',  # nor an id line
    ],
)
def test_a_read_of_whole_events_cuts_only_nulls_that_end_data_events(odd: bytes) -> None:
    content = b'data: {"id":"chatcmpl-1","choices":[{"delta":{"content":"a"},"finish_reason":null}]'
    scanner = StreamScanner(StreamRules(null_usage_added=True))
    read = content + b',"usage":null}\n\n' + odd + content + b',"usage":null}\n\n'
    assert scanner.feed(read) == content + b"}\n\n" + odd + content + b"}\n\n"


def test_usage_on_content_chunk_is_read_before_it_is_removed() -> None:
    scanner = StreamScanner(StreamRules())
    run(scanner, [llamacpp_completions_stream(include_usage=True)])
    assert scanner.usage == Usage(
        prompt_tokens=293,
        completion_tokens=2,
        cached_tokens=292,
        cached_tokens_source="usage.prompt_tokens_details.cached_tokens",
    )


def test_last_event_member_already_on_the_finish_chunk_is_not_duplicated() -> None:
    # mindnano puts its metrics on both the finish chunk and the usage chunk.
    metrics = b',"mindnano_metrics":{"cached_tokens":3}'
    finish = b'data: {"choices":[{"delta":{},"finish_reason":"length","index":0}]' + metrics + b"}\n\n"
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":8}' + metrics + b"}\n\n"
    scanner = StreamScanner(StreamRules())
    assert run(scanner, [finish, usage, b"data: [DONE]\n\n"]) == finish + b"data: [DONE]\n\n"


def test_finish_chunk_is_released_when_no_usage_chunk_follows() -> None:
    finish = b'data: {"choices":[{"delta":{},"finish_reason":"stop","index":0}]}\n\n'
    scanner = StreamScanner(StreamRules())
    assert scanner.feed(finish) == b""  # held: the usage chunk would follow at once
    assert scanner.feed(b"data: [DONE]\n\n") == finish + b"data: [DONE]\n\n"


def test_finish_chunk_of_a_cut_stream_is_released_at_the_end() -> None:
    finish = b'data: {"choices":[{"delta":{},"finish_reason":"stop","index":0}]}\n\n'
    scanner = StreamScanner(StreamRules())
    assert scanner.feed(finish) + scanner.finish() == finish


def test_stream_cut_before_usage_chunk_passes_what_came_and_knows_nothing() -> None:
    injected = openai_chat_stream(include_usage=True)
    cut = injected.index(b'"choices":[]')
    scanner = StreamScanner(StreamRules())
    out = run(scanner, [injected[:cut]])
    direct = openai_chat_stream(include_usage=False)
    assert out == direct[: direct.index(b"data: [DONE]")] + injected[injected.rindex(b"data:", 0, cut) : cut]
    assert scanner.usage.cached_tokens is None and not scanner.saw_usage


def test_null_usage_members_kept_when_engine_always_writes_them() -> None:
    injected = openai_chat_stream(include_usage=True)
    out = run(StreamScanner(StreamRules(null_usage_added=False)), [injected])
    assert (
        out
        == injected[
            : injected.index(
                b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[]'
            )
        ]
        + b"data: [DONE]\n\n"
    )


# --- StreamScanner: stays cheap -----------------------------------------------------


def test_long_stream_without_usage_is_never_decoded() -> None:
    event = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"token"},"finish_reason":null}]}\n\n'
    before = decode_count.value
    scanner = StreamScanner()
    for _ in range(20_000):
        scanner.feed(event)
    scanner.finish()
    assert decode_count.value == before and scanner.usage == Usage()


def test_null_usage_on_every_chunk_decodes_only_the_usage_chunk() -> None:
    event = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"t"}}],"usage":null}\n\n'
    final = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":4,"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
    before = decode_count.value
    scanner = StreamScanner(StreamRules())
    out = b"".join(scanner.feed(event) for _ in range(5_000)) + scanner.feed(final) + scanner.finish()
    assert decode_count.value == before + 1
    assert out == event.replace(b',"usage":null', b"") * 5_000
    assert scanner.usage.cached_tokens == 0


def test_cumulative_meta_info_is_decoded_once_at_the_end() -> None:
    # SGLang /generate streams meta_info on every event; the last one counts.
    events = [
        b'data: {"text":"a'
        + str(i).encode()
        + b'","meta_info":{"prompt_tokens":20,"cached_tokens":16,"completion_tokens":'
        + str(i).encode()
        + b"}}\n\n"
        for i in range(1, 1001)
    ]
    before = decode_count.value
    scanner = StreamScanner()
    for event in events:
        scanner.feed(event)
    scanner.finish()
    assert scanner.usage == Usage(20, 1000, 16, "meta_info.cached_tokens")
    assert decode_count.value == before + 1


def test_responses_and_messages_stream_usage_is_read() -> None:
    responses = (
        b'event: response.completed\ndata: {"type":"response.completed","response":{"usage":'
        b'{"input_tokens":40,"output_tokens":2,"input_tokens_details":{"cached_tokens":32}}}}\n\n'
    )
    scanner = StreamScanner()
    run(scanner, [responses])
    assert scanner.usage == Usage(40, 2, 32, "usage.input_tokens_details.cached_tokens")
    messages = (
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
        b'{"cache_read_input_tokens":7,"input_tokens":1,"output_tokens":0}}}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":5}}\n\n'
    )
    scanner = StreamScanner()
    run(scanner, [messages])
    assert scanner.usage == Usage(8, 5, 7, "usage.cache_read_input_tokens")


def test_oversize_event_passes_through_and_framing_resumes() -> None:
    big = b"data: {" + b'"x":"' + b"a" * (MAX_EVENT_BYTES + 10) + b'"}\r\n\r\n'
    tail = b'data: {"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":1}}}\r\n\r\n'
    data = big + tail + b"data: [DONE]\r\n\r\n"
    scanner = StreamScanner(StreamRules())
    chunks = [data[i : i + 65536] for i in range(0, len(data), 65536)]
    assert run(scanner, chunks) == big + b"data: [DONE]\r\n\r\n"
    assert scanner.usage.cached_tokens == 1


# --- Observation --------------------------------------------------------------------


def test_observation_record_has_schema_header_and_every_field() -> None:
    obs = Observation(
        request_id="r1", session_id="s", case_id="c", method="POST", path="/v1/chat/completions",
        status=200, stream=True, model="m", prompt_tokens=10, completion_tokens=2, cached_tokens=0,
        cached_tokens_source="usage.prompt_tokens_details.cached_tokens", reset_id="x", ordinal_since_reset=1,
        started_ns=1, first_byte_ns=2, finished_ns=3, outcome=Outcome.OK, usage_injected=True,
    )  # fmt: skip
    record = obs.to_record()
    assert list(record)[:3] == ["schema_version", "event_type", "at_ns"]
    assert (record["schema_version"], record["event_type"], record["at_ns"]) == (
        1,
        "infer.cache_observation",
        3,
    )
    # The two spans of the sidecar's added time are one member, `overhead` (null when unmeasured).
    spans = {"added_in_us", "added_out_us"}
    assert set(record) - {"schema_version", "event_type", "at_ns", "overhead"} == (
        set(Observation._fields) - spans
    )
    assert record["overhead"] is None
    measured = obs._replace(added_in_us=12, added_out_us=None).to_record()
    assert measured["overhead"] == {"added_in_us": 12, "added_out_us": None}


# --- JSON answers in bounded memory (issue 16) ----------------------------------------


def test_a_large_json_answer_is_read_in_bounded_memory() -> None:
    usage = {"prompt_tokens": 50, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 32}}
    body = orjson.dumps(
        {"id": "cmpl-1", "choices": [{"text": "y" * (32 << 20)}], "usage": usage, "system_fingerprint": "f"}
    )
    answer = JsonBody()
    most = 0
    for i in range(0, len(body), 65536):
        answer.feed(body[i : i + 65536])
        most = max(most, answer.kept_bytes)
    assert most <= 3 * KEEP_BYTES
    assert answer.usage() == Usage(50, 7, 32, "usage.prompt_tokens_details.cached_tokens")
    assert answer.engine_id() == "cmpl-1"


def test_a_small_json_answer_is_decoded_whole() -> None:
    answer = JsonBody()
    answer.feed(b'{"usage": {"prompt_tokens": 3, ')
    answer.feed(b'"completion_tokens": 1}, "id": "x", "timings": {"cache_n": 2, "prompt_n": 1}}')
    assert answer.usage() == Usage(3, 1, 2, "timings.cache_n") and answer.engine_id() == "x"


_KEYS = st.sampled_from(["id", "object", "usage", "prompt_tokens", "cached_tokens", "choices", "timings"])
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5000) | st.text(max_size=8) | st.just('"id": "x"'),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=12,
)


@given(
    body=st.dictionaries(_KEYS, _JSON, max_size=5),
    first_id=st.none() | st.text(max_size=140) | st.integers(-1000, 10**6),
    compact=st.booleans(),
    cut=st.integers(0, 10_000),
)
@example(body={"choices": {"id": "nested"}}, first_id="top", compact=True, cut=3)
def test_reading_a_json_answer_once_finds_what_usage_and_engine_id_find(
    body: dict[str, Any], first_id: object, compact: bool, cut: int
) -> None:
    """`read()` decodes a whole answer once; it must say what `usage()` and `engine_id()` say, an
    answer that opens with its id, one with more ids (nested, or a later duplicate) and one
    without alike."""
    if first_id is not None:
        body = {"id": first_id, **{k: v for k, v in body.items() if k != "id"}}
    raw = orjson.dumps(body) if compact else json.dumps(body).encode()
    if isinstance(first_id, str) and compact and cut % 3 == 0:
        raw = raw[:-1] + b',"id":"later"}'  # a duplicate: the first one is the engine's id
    answer = JsonBody()
    answer.feed(raw[: cut % (len(raw) + 1)])
    answer.feed(raw[cut % (len(raw) + 1) :])
    assert answer.read() == (answer.usage(), answer.engine_id())


# --- each engine's stream rules -----------------------------------------------------


def test_each_engine_kind_gets_its_own_stream_rules() -> None:
    assert rules_for(EngineInfo(EngineKind.LLAMACPP, "b7000")).inject is False
    assert rules_for(EngineInfo(EngineKind.SGLANG, "0.4.6")).null_usage_added is False
    assert rules_for(EngineInfo(EngineKind.VLLM, "0.32.0")).last_event_members == frozenset(
        {b'"system_fingerprint"'}
    )
    assert rules_for(EngineInfo(EngineKind.GENERIC)) == rules_for(None) == StreamRules()


def test_a_version_entry_applies_from_its_version_on() -> None:
    later = StreamRules(null_usage_added=True)
    table = (
        RuleEntry("sglang", (), StreamRules(null_usage_added=False)),
        RuleEntry("sglang", (0, 5, 10), later),
    )
    assert rules_for(EngineInfo(EngineKind.SGLANG, "0.5.9"), table).null_usage_added is False
    assert rules_for(EngineInfo(EngineKind.SGLANG, "0.5.10rc1"), table) == later
    assert rules_for(EngineInfo(EngineKind.SGLANG, "0.6"), table) == later
    assert rules_for(EngineInfo(EngineKind.SGLANG, None), table).null_usage_added is False


def test_an_engine_that_refused_the_injection_is_remembered_by_kind_and_version() -> None:
    refusals = InjectionRefusals()
    refusals.remember(EngineInfo(EngineKind.GENERIC, "1.0"))
    assert refusals.refused(EngineInfo(EngineKind.GENERIC, "1.0"))
    assert not refusals.refused(EngineInfo(EngineKind.GENERIC, "1.1")) and not refusals.refused(None)
