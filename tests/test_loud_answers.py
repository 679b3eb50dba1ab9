"""Answers a benchmark tool cannot mistake (issue 32): the status says the reset's answer.

Tools read the status only (aiperf, SGLang's bench_serving, `vllm bench sweep`, llm-d-benchmark):
a contradicted reset is a 502 everywhere; with `native_resets = "uniform"` the engines' own
reset routes answer 2xx only for an accepted, uncontradicted reset, 409 refused, 501
unsupported, 502 contradicted, the body in the engine's shape and the X-Cachewitness-* headers
saying the rest. Every reset route takes an empty body, and `/cache/reset` takes its session and
case from the tag headers when the body and the query do not say.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.sim import SimConfig
from tests.support.evidence_files import evidence_records
from tests.support.sidecar import Stack, running_request, stack
from tests.support.sim import fast, slow

NATIVE = {
    "vllm": "/reset_prefix_cache",
    "sglang": "/flush_cache",
    "mindnano": "/v1/cache/clear",
}


def _states(tmp_path: Path) -> list[dict[str, Any]]:
    records = evidence_records(tmp_path / "evidence" / "cachewitness.jsonl")
    return [r for r in records if r["event_type"] == "infer.cache_state"]


def _uniform(config: SimConfig, tmp_path: Path, **overrides: Any) -> Any:
    return stack(config, tmp_path, engine=config.dialect, native_resets="uniform", **overrides)


async def _post(s: Stack, path: str, **kwargs: Any) -> tuple[int, bytes, dict[str, str]]:
    async with s.http.post(f"{s.url}{path}", **kwargs) as resp:
        return resp.status, await resp.read(), dict(resp.headers)


# -- contradicted: 502 ----------------------------------------------------------------------------


async def test_a_contradicted_api_reset_is_502_and_not_worth_a_retry(tmp_path: Path) -> None:
    async with stack(fast("vllm", reset_leaves_warm=True), tmp_path) as s:
        status, body = await s.reset({"session_id": "s", "case_id": "c"})
    assert status == 502, body
    assert (body["answer"], body["success"], body["verified"]) == ("contradicted", False, "contradicted")
    assert body["attempts"] == 1 and body["hint"]


@pytest.mark.parametrize(
    ("dialect", "shaped"),
    [("vllm", b'{"success":false}'), ("sglang", b"Flush cache failed.\n")],
)
async def test_a_contradicted_uniform_native_reset_is_502_in_the_engines_words(
    dialect: str, shaped: bytes, tmp_path: Path
) -> None:
    async with _uniform(fast(dialect, reset_leaves_warm=True), tmp_path) as s:
        status, body, headers = await _post(s, NATIVE[dialect])
    assert (status, body) == (502, shaped)
    assert headers["X-Cachewitness-Answer"] == "contradicted"
    assert headers["X-Cachewitness-Verified"] == "contradicted"
    (state,) = _states(tmp_path)
    assert state["reset_id"] == headers["X-Cachewitness-Reset-Id"] and state["verified"] == "contradicted"


# -- uniform: verified 2xx, refused 409, unsupported 501 --------------------------------------------


@pytest.mark.parametrize("dialect", sorted(NATIVE))
async def test_a_verified_uniform_native_reset_keeps_the_engines_2xx(dialect: str, tmp_path: Path) -> None:
    async with _uniform(fast(dialect), tmp_path) as s:
        status, body, headers = await _post(s, NATIVE[dialect])
        async with s.http.post(f"{s.engine.url}{NATIVE[dialect]}") as direct:
            engine_status, engine_body = direct.status, await direct.read()
    assert (status, body) == (engine_status, engine_body) and 200 <= status < 300
    assert (headers["X-Cachewitness-Answer"], headers["X-Cachewitness-Verified"]) == (
        "acknowledged",
        "verified",
    )


@pytest.mark.parametrize(
    ("dialect", "engine_words"),
    [
        ("vllm", b'{"success":false}'),
        # The uniform reset waits for idle with SGLang's own ?timeout=: its refusal says so.
        ("sglang", b"Timed out waiting for idle state."),
        ("mindnano", b'"type":"busy"'),
    ],
)
async def test_a_uniform_native_reset_still_refused_after_retries_is_409(
    dialect: str, engine_words: bytes, tmp_path: Path
) -> None:
    async with _uniform(slow(dialect), tmp_path, drain=False, retry_seconds=0.3) as s:
        async with running_request(s, max_tokens=2000):
            status, body, headers = await _post(s, NATIVE[dialect])
    assert status == 409 and engine_words in body
    assert headers["X-Cachewitness-Answer"] == "refused"


async def test_a_uniform_native_reset_the_engine_lacks_is_501(tmp_path: Path) -> None:
    async with _uniform(fast("vllm", dev_mode=False), tmp_path) as s:
        status, body, headers = await _post(s, "/reset_prefix_cache")
    assert status == 501 and orjson.loads(body) == {"detail": "Not Found"}
    assert headers["X-Cachewitness-Answer"] == "unsupported"


async def test_engine_mode_still_gives_the_engines_own_status(tmp_path: Path) -> None:
    async with stack(slow("vllm"), tmp_path, engine="vllm") as s:
        async with running_request(s, max_tokens=2000):
            status, body, headers = await _post(s, "/reset_prefix_cache")
    assert (status, orjson.loads(body)) == (200, {"success": False})
    assert headers["X-Cachewitness-Answer"] == "refused"


# -- empty bodies -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dialect", "path"),
    [
        ("vllm", "/cache/reset"),
        ("vllm", "/reset_prefix_cache"),
        ("sglang", "/flush_cache"),
        ("mindnano", "/v1/cache/clear"),
        ("llamacpp", "/slots/0?action=erase"),
    ],
)
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_every_reset_route_takes_an_empty_body(
    dialect: str, path: str, framing: str, tmp_path: Path
) -> None:
    config = fast(dialect, slot_save_path=".") if dialect == "llamacpp" else fast(dialect)
    headers = {"Content-Type": "application/json"}
    async with _uniform(config, tmp_path) as s:
        if framing == "chunked":

            async def nothing() -> Any:
                return
                yield b""

            status, body, _ = await _post(s, path, data=nothing(), headers=headers)
        else:
            status, body, _ = await _post(s, path, data=b"", headers=headers)
    assert 200 <= status < 300, body
    assert len(_states(tmp_path)) == 1


# -- tags from the headers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "body", "expected"),
    [
        ("", None, ("hdr-s", "hdr-c")),
        ("?session_id=q-s", None, ("q-s", "hdr-c")),
        ("?session_id=q-s&case_id=q-c", {"session_id": "b-s"}, ("b-s", "q-c")),
        ("", {"session_id": "b-s", "case_id": None}, ("b-s", "hdr-c")),
    ],
)
async def test_cache_reset_takes_its_tags_from_the_headers_when_body_and_query_do_not(
    query: str, body: dict[str, Any] | None, expected: tuple[str, str], tmp_path: Path
) -> None:
    tags = {"X-Session-Id": "hdr-s", "X-Case-Id": "hdr-c"}
    data = orjson.dumps(body) if body is not None else b""
    async with stack(fast("vllm"), tmp_path) as s:
        status, raw, _ = await _post(s, f"/cache/reset{query}", data=data, headers=tags)
    answer = orjson.loads(raw)
    assert status == 200, answer
    assert (answer["session_id"], answer["case_id"]) == expected
    (state,) = _states(tmp_path)
    assert (state["session_id"], state["case_id"]) == expected


async def test_a_tag_header_outside_the_id_rule_is_400_naming_it(tmp_path: Path) -> None:
    async with stack(fast("vllm"), tmp_path) as s:
        status, raw, _ = await _post(s, "/cache/reset", headers={"X-Case-Id": "a case"})
    assert status == 400 and orjson.loads(raw)["error"]["param"] == "X-Case-Id"
