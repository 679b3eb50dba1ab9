"""`observe = false` (`--no-observe`, the bare sidecar): every request forwarded, none read or recorded.

The switch is the bare path's, on both servers: no request body is read, no `include_usage` is
injected, no observation is written; the requests are still forwarded and counted. Each case
runs beside its twin with the switch on, so both paths are seen to run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.evidence_files import evidence_records
from tests.support.metrics import scrape
from tests.support.sidecar import stack
from tests.support.sim import chat, fast, read_events

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize("front", [True, False], ids=["front", "aiohttp"])
@pytest.mark.parametrize("observe", [True, False], ids=["observed", "not-observed"])
async def test_with_observe_off_requests_are_forwarded_and_none_is_recorded(
    tmp_path: Path, front: bool, observe: bool
) -> None:
    async with stack(fast("vllm"), tmp_path, front=front, observe=observe) as s:
        async with s.http.post(s.url + CHAT, json=chat("hello", 4)) as resp:
            assert resp.status == 200
            answer = await resp.json()
        async with s.http.post(s.url + CHAT, json=chat("hello", 4, stream=True)) as resp:
            assert resp.status == 200
            events = await read_events(resp)
        engine = await s.engine.stats()
        served_by = "front" if front else "aiohttp"
        forwarded = (await scrape(s.http, s.url)).value(
            "cachewitness_requests_total", route=CHAT, code="2xx", served_by=served_by
        )
    assert answer["usage"]["completion_tokens"] == 4
    assert events[-1] == b"data: [DONE]"
    assert all(b'"usage"' not in event for event in events)  # the client asked for none
    assert forwarded == 2 and engine["requests_total"] == 2
    evidence = evidence_records(tmp_path / "evidence" / "cachewitness.jsonl")
    observations = [r for r in evidence if r["event_type"] == "infer.cache_observation"]
    if observe:
        # Read on the way: the stream's usage came from the injected include_usage.
        assert [(o["stream"], o["usage_injected"], o["prompt_tokens"]) for o in observations] == [
            (False, False, answer["usage"]["prompt_tokens"]),
            (True, True, answer["usage"]["prompt_tokens"]),
        ]
    else:
        assert observations == []
