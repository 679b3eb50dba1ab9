"""The isolation member written into a request body byte-wise (proxy/isolation/rewrite.py), on bytes."""

from __future__ import annotations

import orjson
import pytest

from proxy.isolation import Unrewritable, isolated_body, isolated_request, rule_for
from proxy.isolation.rules import IsolationRule
from proxy.observe import prepare_request
from proxy.vocabulary import EngineKind


class _Engine:
    def __init__(self, kind: str, version: str | None) -> None:
        self.kind, self.version = kind, version


def _rule(kind: str, version: str | None = None, path: str = "/v1/chat/completions") -> IsolationRule:
    rule = rule_for(_Engine(kind, version), path)
    assert rule is not None
    return rule


VLLM = _rule(EngineKind.VLLM, "0.32.0")
LLAMA = _rule(EngineKind.LLAMACPP, "b6000")


def test_a_salt_is_appended_and_every_other_byte_kept() -> None:
    body = b'{ "model" : "m",\n  "messages": [{"role": "user", "content": "caf\\u00e9"}] }  '
    out = isolated_body(body, VLLM)
    close = body.rindex(b"}")
    assert out.startswith(body[:close])
    assert out.endswith(body[close:])
    salt = orjson.loads(out)["cache_salt"]
    assert len(salt) == 22  # 16 bytes: 128 bits, URL-safe base64
    assert not set(salt) & set("@/\\\x00")


def test_each_request_gets_its_own_salt() -> None:
    salts = {orjson.loads(isolated_body(b'{"a":1}', VLLM))["cache_salt"] for _ in range(64)}
    assert len(salts) == 64


def test_a_clients_salt_is_kept_as_the_prefix() -> None:
    out = orjson.loads(isolated_body(b'{"cache_salt": "tenant-7", "x": [1]}', VLLM))
    assert out["cache_salt"].startswith("tenant-7")
    assert len(out["cache_salt"]) == len("tenant-7") + 22
    assert out["x"] == [1]


@pytest.mark.parametrize("body", [b"{}", b"{" + b" " * 20000 + b"}"])  # decoded whole; scanned
def test_an_empty_object_gets_no_comma(body: bytes) -> None:
    assert orjson.loads(isolated_body(body, LLAMA)) == {"cache_prompt": False}


def test_cache_prompt_true_becomes_false_in_place() -> None:
    body = b'{"cache_prompt": true, "prompt": "hi"}'
    assert isolated_body(body, LLAMA) == b'{"cache_prompt": false, "prompt": "hi"}'


@pytest.mark.parametrize("body", [b"[1, 2]", b"not json", b'"text"', b"", b'{"a": 1} {"b": 2}'])
def test_a_body_that_is_not_one_object_is_refused(body: bytes) -> None:
    with pytest.raises(Unrewritable, match="one JSON object"):
        isolated_body(body, VLLM)


def test_a_null_client_salt_is_as_none_and_replaced() -> None:
    out = isolated_body(b'{"cache_salt": null, "n": 1}', VLLM)
    assert len(orjson.loads(out)["cache_salt"]) == 22
    assert out.count(b"cache_salt") == 1


@pytest.mark.parametrize("salt", [b'""', b"5", b'["a"]'])
def test_a_client_salt_that_is_no_string_is_refused(salt: bytes) -> None:
    with pytest.raises(Unrewritable, match="non-empty string"):
        isolated_body(b'{"cache_salt": ' + salt + b"}", VLLM)


def test_a_client_salt_too_long_for_ours_after_it_is_refused() -> None:
    isolated_body(b'{"cache_salt": "' + b"a" * 106 + b'"}', VLLM)
    with pytest.raises(Unrewritable, match="at most 106"):
        isolated_body(b'{"cache_salt": "' + b"a" * 107 + b'"}', VLLM)


def test_rules_by_engine_route_and_version() -> None:
    assert rule_for(_Engine(EngineKind.VLLM, "0.8.5"), "/v1/chat/completions") is None
    assert rule_for(_Engine(EngineKind.VLLM, None), "/v1/chat/completions") is None
    assert _rule(EngineKind.SGLANG, "0.5.3").field == "cache_salt"
    assert _rule(EngineKind.SGLANG, "0.5.10", "/generate").field == "extra_key"
    assert rule_for(_Engine(EngineKind.SGLANG, "0.5.2"), "/v1/chat/completions") is None
    assert _rule(EngineKind.MINDNANO, "0.1.0").field == "cache_prompt"
    assert rule_for(_Engine(EngineKind.LLAMACPP, "b6000"), "/v1/responses") is None
    assert rule_for(_Engine(EngineKind.GENERIC, "1"), "/v1/chat/completions") is None


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "stream": true, "messages": []}',  # both appended at the closing brace
        b'{"stream": true, "stream_options": {"x": 1}, "cache_salt": "c", "n": 1}',  # both replaced in place
        b'{"cache_salt": "c", "stream": true, "stream_options": {}}',  # the injection after the salt
        b'{"stream": true, "pad": "' + b"p" * 20000 + b'"}',  # scanned, not decoded whole
    ],
)
def test_the_usage_injection_stands_beside_the_salt_and_its_retry_keeps_the_salt(body: bytes) -> None:
    prepared = prepare_request(body, inject_usage=True, path="/v1/chat/completions")
    assert prepared.usage_injected
    isolated = isolated_request(prepared, VLLM)
    sent = orjson.loads(isolated.upstream_body())
    assert sent["stream_options"]["include_usage"] is True
    assert len(sent["cache_salt"]) in (22, 23)
    assert {k: v for k, v in sent.items() if k not in ("cache_salt", "stream_options")} == {
        k: v for k, v in orjson.loads(body).items() if k not in ("cache_salt", "stream_options")
    }
    # An engine that refuses the injection gets the client's request again: still isolated.
    retried = orjson.loads(isolated.without_injection().upstream_body())
    assert retried["cache_salt"] == sent["cache_salt"]
