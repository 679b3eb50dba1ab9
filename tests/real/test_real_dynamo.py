"""The real NVIDIA Dynamo 1.6.1 (frontend over its mocker engine, on this CPU machine) behind the sidecar.

What was seen here and what the sidecar must make of it (docs/engines.md): `--engine auto` finds
Dynamo by its `/health`; the frontend's cached tokens reach the client and the evidence; its
`/metrics` merges whole; and this release's frontend has no `/clear_kv_blocks` (404), so a reset
is `unsupported` with a hint, never a success.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.real import engines, sidecar_client
from tests.real.conftest import Pair
from tests.support.metrics import Scrape

PROMPT = "the quick brown fox jumps over the lazy dog " * 20


def chat(url: str) -> dict[str, Any]:
    """One chat completion of PROMPT; its usage."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    status, answer = engines.http_json("POST", url + "/v1/chat/completions", body)
    assert status == 200 and isinstance(answer, dict), answer
    usage: dict[str, Any] = answer["usage"]
    return usage


def test_auto_detects_the_frontend(dynamo: Pair) -> None:
    status, state = engines.http_json("GET", dynamo.url + "/cache/state")
    assert status == 200 and isinstance(state, dict)
    assert state["engine"] == {"kind": "dynamo", "version": None}


def test_cached_tokens_reach_the_client_through_the_sidecar(dynamo: Pair) -> None:
    first, second = chat(dynamo.url), chat(dynamo.url)
    assert second["prompt_tokens"] == first["prompt_tokens"]
    # Block-granular: the repeat finds all but the last partial block (704 of 739 when seen).
    assert 0 < second["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens"]


def test_the_frontends_metrics_merge_whole(dynamo: Pair) -> None:
    chat(dynamo.url)
    status, text = engines.http_json("GET", dynamo.url + "/metrics")
    assert status == 200 and isinstance(text, str)
    scrape = Scrape(text)  # parses the whole exposition as Prometheus does
    assert scrape.value("cachewitness_upstream_metrics_up") == 1
    assert "dynamo_frontend_cached_tokens" in scrape.families


def test_a_reset_of_this_frontend_is_unsupported_never_a_success(dynamo: Pair) -> None:
    status, body = engines.http_json("POST", dynamo.url + "/cache/reset", {"verify": "none"})
    assert isinstance(body, dict)
    assert (status, body["answer"], body["success"]) == (501, "unsupported", False), body
    assert body["calls"][-1]["status"] == 404 and body["calls"][-1]["url"].endswith("/clear_kv_blocks")
    assert "/clear_kv_blocks" in body["hint"]


async def test_a_stream_keeps_its_shape_and_its_injected_usage_is_observed(dynamo: Pair) -> None:
    """No include_usage asked: the sidecar injects it, reads the usage chunk, and removes it again."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    session_id, case_id = sidecar_client.new_case()
    async with aiohttp.ClientSession() as http:
        direct = await sidecar_client.stream(http, dynamo.engine_url, body, path="/v1/chat/completions")
        through = await sidecar_client.stream(
            http, dynamo.url, body, sidecar_client.tags(session_id, case_id), path="/v1/chat/completions"
        )
        (observed,) = await sidecar_client.observations(http, dynamo.url, case_id, 1)
    assert through.done and sidecar_client.chunk_shapes(through.events) == sidecar_client.chunk_shapes(
        direct.events
    )
    assert all("usage" not in event for event in through.events)
    assert observed["usage_injected"] is True
    assert observed["cached_tokens"] > 0  # the direct stream cached the prompt a moment before
