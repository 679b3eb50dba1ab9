"""Evidence end to end: sim engine → sidecar → evidence file, for every dialect."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.sim import running_sim
from tests.support.client import CLIENT_TIMEOUT
from tests.support.evidence_files import CHAIN_EVENTS
from tests.support.sidecar import SidecarFactory
from tests.support.sim import chat, fast, slow, words

PROMPT = words(80)


async def evidence(http: aiohttp.ClientSession, proxy: str, **filters: str) -> list[dict[str, Any]]:
    async with http.get(proxy + "/cache/evidence", params=filters) as response:
        assert response.status == 200, await response.text()
        return [orjson.loads(line) for line in (await response.read()).splitlines() if line]


async def observations(http: aiohttp.ClientSession, proxy: str) -> list[dict[str, Any]]:
    return await evidence(http, proxy, event_type="infer.cache_observation")


async def post_chat(http: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str) -> bytes:
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        return await response.read()


async def reset(http: aiohttp.ClientSession, proxy: str, **body: Any) -> dict[str, Any]:
    async with http.post(proxy + "/cache/reset", json=body) as response:
        answer: dict[str, Any] = await response.json()
        return answer


CACHED_FIELD = {
    "vllm": "usage.prompt_tokens_details.cached_tokens",
    "sglang": "usage.prompt_tokens_details.cached_tokens",
    "llamacpp": "usage.prompt_tokens_details.cached_tokens",
    "mindnano": "usage.prompt_tokens_details.cached_tokens",
    "openai": "usage.prompt_tokens_details.cached_tokens",
}


@pytest.mark.parametrize("dialect", sorted(CACHED_FIELD))
@pytest.mark.parametrize("stream", [False, True])
async def test_cached_tokens_observed_zero_then_more(
    sidecar: SidecarFactory, http: aiohttp.ClientSession, dialect: str, stream: bool
) -> None:
    async with running_sim(fast(dialect, slot_save_path="/tmp")) as engine:
        proxy = await sidecar(engine)
        for _ in range(2):
            await post_chat(
                http, proxy, chat(PROMPT, stream=stream), **{"X-Session-Id": "s", "X-Case-Id": "c"}
            )
        first, second = await observations(http, proxy)
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] > 0
    assert first["prompt_tokens"] == second["prompt_tokens"]
    # An exact repeat: mindnano reuses its saved logits, the others recompute the last token.
    if dialect == "mindnano":
        assert second["cached_tokens"] == second["prompt_tokens"]
    else:
        assert second["cached_tokens"] < second["prompt_tokens"]
    assert first["stream"] is stream and first["outcome"] == "ok" and first["status"] == 200
    assert first["session_id"] == "s" and first["case_id"] == "c"
    assert first["cached_tokens_source"] is not None
    # llama.cpp streams need no injection: its finish chunk carries timings.cache_n.
    assert first["usage_injected"] is (stream and dialect != "llamacpp")


async def test_sglang_generate_reads_meta_info(sidecar: SidecarFactory, http: aiohttp.ClientSession) -> None:
    async with running_sim(fast("sglang")) as engine:
        proxy = await sidecar(engine)
        for _ in range(2):
            async with http.post(
                proxy + "/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 4}}
            ) as r:
                assert r.status == 200
        first, second = await observations(http, proxy)
    assert first["cached_tokens_source"] == "meta_info.cached_tokens"
    assert first["cached_tokens"] == 0 and second["cached_tokens"] > 0


async def test_engine_without_cached_field_records_null_not_zero(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with running_sim(fast("vllm", prompt_tokens_details=False)) as engine:
        proxy = await sidecar(engine)
        await post_chat(http, proxy, chat(PROMPT))
        await post_chat(http, proxy, chat(PROMPT, stream=True))
        records = await observations(http, proxy)
    assert [r["cached_tokens"] for r in records] == [None, None]
    assert [r["cached_tokens_source"] for r in records] == [None, None]
    assert records[0]["prompt_tokens"] is not None


def normalise(stream: bytes) -> bytes:
    """Ids, timestamps and measured durations differ between two runs of a request; nothing else may."""
    stream = re.sub(rb'"(\w+_ms|\w+_per_second)":\s*[-0-9.eE+]+', rb'"\1":0', stream)
    stream = re.sub(rb'"id":\s*"[^"]*"', b'"id":"X"', stream)
    return re.sub(rb'"created":\s*\d+', b'"created":0', stream)


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "mindnano", "openai", "llamacpp"])
async def test_injected_usage_is_stripped_byte_for_byte(
    sidecar: SidecarFactory, http: aiohttp.ClientSession, dialect: str
) -> None:
    # Two identical engines, so both requests meet the same (cold) cache.
    async with running_sim(fast(dialect)) as engine, running_sim(fast(dialect)) as twin:
        proxy = await sidecar(engine)
        body = chat(words(40, "beta"), max_tokens=12, stream=True)
        direct = await post_chat(http, twin, body)
        through = await post_chat(http, proxy, body)
        [record] = await observations(http, proxy)
    # llama.cpp needs no injection: its finish chunk carries timings.cache_n.
    assert record["usage_injected"] is (dialect != "llamacpp") and record["completion_tokens"] == 12
    assert record["cached_tokens"] == 0
    assert normalise(through) == normalise(direct)


async def test_client_asking_for_usage_gets_it_untouched(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with running_sim(fast("vllm")) as engine, running_sim(fast("vllm")) as twin:
        proxy = await sidecar(engine)
        body = chat(PROMPT, stream=True, stream_options={"include_usage": True})
        direct = await post_chat(http, twin, body)
        through = await post_chat(http, proxy, body)
        [record] = await observations(http, proxy)
    assert record["usage_injected"] is False and record["prompt_tokens"] is not None
    assert normalise(through) == normalise(direct)


async def test_stream_cut_before_usage_is_recorded_and_proxy_keeps_serving(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with running_sim(slow("vllm")) as engine:
        proxy = await sidecar(engine)
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as leaving:
            response = await leaving.post(
                proxy + "/v1/chat/completions", json=chat(PROMPT, max_tokens=200, stream=True)
            )
            await response.content.readuntil(b"\n\n")
            response.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        records: list[dict[str, Any]] = []
        while not records and loop.time() < deadline:
            records = await observations(http, proxy)
            await asyncio.sleep(0.05)
        await post_chat(http, proxy, chat("still serving"))
    assert records[0]["outcome"] == "client_disconnected"
    assert records[0]["cached_tokens"] is None


async def test_secrets_never_reach_the_evidence(
    sidecar: SidecarFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    secret_key, secret_user, secret_prompt = "sk-SECRETKEY123", "user-SECRET-42", "SECRETPROMPTWORD"
    async with running_sim(fast("mindnano")) as engine:
        proxy = await sidecar(engine)
        body = chat(f"{secret_prompt} {PROMPT}", user=secret_user)
        await post_chat(http, proxy, body, Authorization=f"Bearer {secret_key}")
        await post_chat(http, proxy, {**body, "stream": True}, Authorization=f"Bearer {secret_key}")
        await reset(http, proxy, session_id="s1", case_id="c1")
        await post_chat(http, proxy, body, Authorization=f"Bearer {secret_key}")
        assert len(await observations(http, proxy)) == 3
    files = list((tmp_path / "evidence").iterdir())
    assert files
    for file in files:
        text = file.read_text()
        for secret in (secret_key, secret_user, secret_prompt):
            assert secret not in text


async def test_verdict_consistent_after_a_real_reset(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with running_sim(fast("vllm")) as engine:
        proxy = await sidecar(engine)
        await post_chat(http, proxy, chat(PROMPT))
        answer = await reset(http, proxy, session_id="s", case_id="cold")
        assert answer["answer"] == "acknowledged"
        await post_chat(http, proxy, chat(PROMPT), **{"X-Session-Id": "s", "X-Case-Id": "cold"})
        await post_chat(http, proxy, chat(PROMPT), **{"X-Session-Id": "s", "X-Case-Id": "cold"})
        [verification] = await evidence(http, proxy, event_type="infer.cache_verification")
        async with http.get(proxy + "/cache/state") as response:
            state = await response.json()
        records = await observations(http, proxy)
    assert verification["verdict"] == "consistent" and verification["cached_tokens"] == 0
    assert verification["reset_id"] == answer["reset_id"]
    assert (verification["session_id"], verification["case_id"]) == ("s", "cold")
    assert state["verdict"] == "consistent"
    assert [r["ordinal_since_reset"] for r in records] == [None, 1, 2]
    assert records[0]["reset_id"] is None and records[1]["reset_id"] == answer["reset_id"]


async def test_verdict_contradicted_when_llamacpp_ram_cache_survives_erase(
    sidecar: SidecarFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    async with running_sim(fast("llamacpp", slot_save_path=str(tmp_path), ram_cache=True)) as engine:
        proxy = await sidecar(engine)
        await post_chat(http, proxy, chat(PROMPT))
        # No canary: the traffic is the only witness here.
        answer = await reset(http, proxy, case_id="cold", verify="none")
        assert answer["answer"] == "acknowledged"
        await post_chat(http, proxy, chat(PROMPT))
        [verification] = await evidence(http, proxy, event_type="infer.cache_verification")
    assert verification["verdict"] == "contradicted" and verification["cached_tokens"] > 0


async def test_verdict_unobservable_when_engine_reports_nothing(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with running_sim(fast("vllm", prompt_tokens_details=False)) as engine:
        proxy = await sidecar(engine)
        answer = await reset(http, proxy, case_id="cold")
        assert answer["answer"] == "acknowledged"
        await post_chat(http, proxy, chat(PROMPT))
        [verification] = await evidence(http, proxy, event_type="infer.cache_verification")
    assert verification["verdict"] == "unobservable" and verification["cached_tokens"] is None


async def test_evidence_filters_select_records(sidecar: SidecarFactory, http: aiohttp.ClientSession) -> None:
    async with running_sim(fast("vllm")) as engine:
        proxy = await sidecar(engine)
        await reset(http, proxy, session_id="s1", case_id="a")
        await post_chat(http, proxy, chat(PROMPT), **{"X-Session-Id": "s1", "X-Case-Id": "a"})
        await reset(http, proxy, session_id="s1", case_id="b")
        await post_chat(http, proxy, chat(PROMPT), **{"X-Session-Id": "s1", "X-Case-Id": "b"})
        everything = await evidence(http, proxy)
        case_b = await evidence(http, proxy, case_id="b")
        # Both filters hold together: the session does not widen the case.
        session_and_case = await evidence(http, proxy, session_id="s1", case_id="a")
        states = await evidence(http, proxy, event_type="infer.cache_state")
        later = await evidence(http, proxy, since_ns=str(states[1]["at_ns"]))
        async with http.get(proxy + "/cache/evidence", params={"since_ns": "yesterday"}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "since_ns"
    assert {r["case_id"] for r in case_b} == {"b"} and len(case_b) >= 2
    assert [r["case_id"] for r in states] == ["a", "b"]
    assert {r["case_id"] for r in session_and_case} == {"a"} and len(session_and_case) >= 2
    assert all(r["at_ns"] >= states[1]["at_ns"] for r in later) and len(later) < len(everything)
    # since_ns is inclusive: the record written at that very time is among them.
    assert states[1] in later


async def test_full_disk_is_counted_and_forwarding_goes_on(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with running_sim(fast("vllm")) as engine:
        # /dev/full: every write fails with ENOSPC, as a full disk does (root or not).
        proxy = await sidecar(engine, evidence="/dev/full")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        errors = 0
        while errors == 0:
            assert loop.time() < deadline, "the write error was never counted"
            await post_chat(http, proxy, chat(PROMPT))
            async with http.get(proxy + "/cache/state") as response:
                errors = (await response.json())["sidecar"]["evidence_write_errors_total"]
            await asyncio.sleep(0.05)
        await post_chat(http, proxy, chat(PROMPT))
        async with http.get(proxy + "/metrics") as response:
            assert "cachewitness_evidence_write_errors_total" in await response.text()


async def test_evidence_larger_than_one_write_comes_back_whole(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with running_sim(fast("vllm")) as engine:
        proxy = await sidecar(engine)
        for index in range(300):
            await post_chat(http, proxy, chat(f"prompt {index}"), **{"X-Case-Id": f"case-{index}"})
        async with http.get(proxy + "/cache/evidence") as response:
            raw = await response.read()
    assert len(raw) > 64 * 1024
    records = [orjson.loads(line) for line in raw.splitlines()]
    # Each file's writer opened its chain first (docs/evidence.md); then the records, in order.
    assert [r["event_type"] for r in records[:2]] == ["infer.evidence_opened"] * 2
    observed = [r for r in records if r["event_type"] not in CHAIN_EVENTS]
    assert [r["case_id"] for r in observed] == [f"case-{i}" for i in range(300)]


async def test_evidence_filter_with_a_trailing_newline_is_400(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with running_sim(fast("vllm")) as engine:
        proxy = await sidecar(engine)
        async with http.get(proxy + "/cache/evidence", params={"case_id": "a\n"}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "case_id"


async def test_a_1000_character_session_id_is_recorded_cut_to_128(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    long_session, long_case = "s" * 127 + "-" * 873, "c" * 128 + "x" * 872
    async with running_sim(fast("vllm")) as engine:
        proxy = await sidecar(engine)
        await post_chat(http, proxy, chat(PROMPT), **{"X-Session-Id": long_session, "X-Case-Id": long_case})
        (record,) = await observations(http, proxy)
        # The cut id is a valid filter, and finds the record.
        found = await evidence(http, proxy, session_id=long_session[:128])
    assert record["session_id"] == long_session[:128] and len(record["session_id"]) == 128
    assert record["case_id"] == long_case[:128]
    assert [r["request_id"] for r in found] == [record["request_id"]]


@pytest.mark.parametrize("since_ns", ["1_000", " 12 ", "\u0663", "+5", "-5", "", "1" * 21])
async def test_evidence_since_ns_other_than_ascii_digits_is_400(
    sidecar: SidecarFactory, http: aiohttp.ClientSession, since_ns: str
) -> None:
    async with running_sim(fast("vllm")) as engine:
        proxy = await sidecar(engine)
        async with http.get(proxy + "/cache/evidence", params={"since_ns": since_ns}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "since_ns"
        # Digits, leading zeros included: only the writers' openings are there (no request was made).
        opened = await evidence(http, proxy, since_ns="0012")
        assert [r["event_type"] for r in opened] == ["infer.evidence_opened"] * 2


@pytest.mark.parametrize("name", ["session_id", "case_id", "event_type", "since_ns", "scope"])
async def test_evidence_filter_given_twice_is_400(
    sidecar: SidecarFactory, http: aiohttp.ClientSession, name: str
) -> None:
    value = {"event_type": "infer.cache_state", "scope": "pod"}.get(name, "1")
    async with running_sim(fast("vllm")) as engine:
        proxy = await sidecar(engine)
        await reset(http, proxy, session_id="1", case_id="1")
        async with http.get(proxy + "/cache/evidence", params=[(name, value), (name, value)]) as response:
            assert response.status == 400
            error = (await response.json())["error"]
        assert error["param"] == name and error["code"] == "invalid_filter"
