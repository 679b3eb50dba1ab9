"""`GET /metrics`: the sidecar's families, their bounded labels, and the merge with the engine's."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.evidence.log import EVIDENCE
from proxy.metrics import ENGINE_METRICS_MAX_AGE_S, METRICS
from proxy.sim import SimConfig, build_sim_app, running_sim
from tests.support.metrics import scrape
from tests.support.sidecar import SidecarFactory, closed_port_url, serve_app, serve_sidecar
from tests.support.sim import sim as sim_client
from tests.support.sim import slow

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "config" / "grafana-dashboard.json"

# Every family docs/metrics.md names.
FAMILIES = (
    "cachewitness_requests_total",
    "cachewitness_request_duration_seconds",
    "cachewitness_time_to_first_byte_seconds",
    "cachewitness_prompt_tokens_total",
    "cachewitness_cached_tokens_total",
    "cachewitness_responses_without_cached_tokens_total",
    "cachewitness_cached_tokens_unknown_total",  # its deprecated alias, kept one release
    "cachewitness_request_cached_tokens",
    "cachewitness_cache_resets_total",
    "cachewitness_cache_reset_duration_seconds",
    "cachewitness_cache_reset_attempts",
    "cachewitness_inflight_requests",
    "cachewitness_draining",
    "cachewitness_upstream_errors_total",
    "cachewitness_evidence_records_total",
    "cachewitness_evidence_write_errors_total",
    "cachewitness_engine_info",
    "cachewitness_upstream_up",
    "cachewitness_upstream_metrics_up",
    "cachewitness_sidecar_overhead_seconds",
    "cachewitness_added_seconds",
    "cachewitness_cache_verifications_total",
    "cachewitness_evidence_dropped_total",
    "cachewitness_evidence_pending_bytes",
    "cachewitness_client_connections",
    "cachewitness_connection_limit_hits_total",
    "cachewitness_buffered_request_bytes",
    "cachewitness_requests_unobserved_total",
)
MODEL_FAMILIES = (
    "cachewitness_prompt_tokens_total",
    "cachewitness_cached_tokens_total",
    "cachewitness_responses_without_cached_tokens_total",
    "cachewitness_request_cached_tokens_count",
)


def fast(dialect: str, **options: Any) -> SimConfig:
    """A simulator with no prefill or decode delay."""
    return SimConfig(dialect=dialect, decode_rate=0, prefill_rate=0, **options)


def chat(content: str, model: str = "sim-model") -> dict[str, Any]:
    """A one-message chat request body."""
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}


PROMPT = " ".join(f"word{i}" for i in range(60))


async def post_chat(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST a non-stream chat completion; return its usage."""
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        usage: dict[str, Any] = (await resp.json())["usage"]
        return usage


@asynccontextmanager
async def engine_serving_metrics(body: bytes, content_type: str) -> AsyncIterator[str]:
    """A tiny real engine whose `/metrics` answers `body` (and nothing else)."""

    async def metrics(request: web.Request) -> web.Response:
        """The canned exposition."""
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with serve_app(app) as url:
        yield url


# --- families and labels -------------------------------------------------------------------------


async def test_every_family_is_present_right_after_start(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """A scrape before any request already shows every family, labelled ones with zero series."""
    async with running_sim(fast("vllm")) as engine:
        url = await sidecar(engine)
        first = await scrape(http, url)
    declared = set(first.type_lines())
    sampled = {name for name in first.names() for family in FAMILIES if name.startswith(family)}
    assert sorted(set(FAMILIES) - declared) == []
    assert sorted(family for family in FAMILIES if not any(name.startswith(family) for name in sampled)) == []
    assert (
        first.value(
            "cachewitness_requests_total", route="/v1/chat/completions", code="2xx", served_by="front"
        )
        == 0
    )
    assert first.value("cachewitness_prompt_tokens_total", model="sim-model") == 0
    assert first.value("cachewitness_cache_resets_total", engine="vllm", answer="refused") == 0
    assert first.value("cachewitness_cache_verifications_total", verdict="contradicted") == 0


async def test_docs_metrics_names_every_family_the_sidecar_exports(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """Each `cachewitness_` family of a live scrape is in docs/metrics.md's table (without its prefix)."""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    async with running_sim(fast("vllm")) as engine:
        url = await sidecar(engine)
        result = await scrape(http, url)
    exported = [name for name in result.type_lines() if name.startswith("cachewitness_")]
    assert len(exported) >= len(FAMILIES)
    prefix = len("cachewitness_")
    assert [name for name in exported if f"`{name[prefix:]}`" not in doc] == []


async def test_exposition_has_one_help_per_family_no_created_series_and_no_document_citations(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """After traffic and a reset: each `# HELP` name once, no `*_created` sample, no HELP citing a document."""
    async with running_sim(fast("vllm")) as engine:
        url = await sidecar(engine)
        await post_chat(http, url, chat(PROMPT))
        async with http.post(url + "/cache/reset", json={"retry_seconds": 0}) as resp:
            assert resp.status == 200
        result = await scrape(http, url)
    helps = [line for line in result.text.splitlines() if line.startswith("# HELP cachewitness_")]
    names = [line.split()[2] for line in helps]
    assert sorted({name for name in names if names.count(name) > 1}) == []
    assert sorted(name for name in result.names() if name.endswith("_created")) == []
    assert [line for line in helps if re.search(r"SPEC|§|docs/", line)] == []


async def test_resets_are_precreated_for_the_detected_engine_only(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """Before any reset: one zero per answer (contradicted included) for the engine there, none for others."""
    async with running_sim(fast("sglang")) as engine:
        url = await sidecar(engine)
        result = await scrape(http, url)
    assert result.label_values("cachewitness_cache_resets_total", "engine") == {"sglang"}
    assert result.label_values("cachewitness_cache_resets_total", "answer") == {
        "acknowledged", "accepted_unverified", "refused", "unsupported", "unreachable", "error", "contradicted",
    }  # fmt: skip
    assert result.value("cachewitness_cache_resets_total", engine="sglang", answer="contradicted") == 0


async def test_reset_the_canary_contradicts_counts_as_contradicted_not_acknowledged(
    tmp_path: Path, sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """llama.cpp with its RAM prompt cache: the erase is acknowledged, the canary still hits."""
    async with running_sim(fast("llamacpp", slot_save_path=str(tmp_path), ram_cache=True)) as engine:
        url = await sidecar(engine)
        async with http.post(url + "/cache/reset", json={"retry_seconds": 0}) as resp:
            assert (await resp.json())["answer"] == "contradicted"
        result = await scrape(http, url)
    assert result.value("cachewitness_cache_resets_total", engine="llamacpp", answer="contradicted") == 1
    assert result.value("cachewitness_cache_resets_total", engine="llamacpp", answer="acknowledged") == 0
    assert result.value("cachewitness_cache_resets_verified_total", verified="contradicted") == 1


async def test_engine_info_shows_the_detected_kind_and_version(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """engine_info carries the kind and version that `--engine auto` detected."""
    async with running_sim(fast("sglang")) as engine:
        url = await sidecar(engine)
        result = await scrape(http, url)
    assert result.value("cachewitness_engine_info", kind="sglang", version="0.5.10") == 1


async def test_forwarded_request_moves_requests_duration_and_ttfb(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """One forwarded request adds one to requests_total and one observation to each latency histogram."""
    async with running_sim(fast("vllm")) as engine:
        url = await sidecar(engine)
        before = await scrape(http, url)
        async with http.get(url + "/v1/models") as resp:
            assert resp.status == 200
        after = await scrape(http, url)

    def delta(name: str, **labels: str) -> float:
        """How much a sample moved between the two scrapes."""
        return after.value(name, **labels) - before.value(name, **labels)

    assert delta("cachewitness_requests_total", route="/v1/models", code="2xx", served_by="aiohttp") == 1
    assert delta("cachewitness_request_duration_seconds_count", route="/v1/models") == 1
    assert delta("cachewitness_time_to_first_byte_seconds_count", route="/v1/models") == 1
    assert delta("cachewitness_sidecar_overhead_seconds_count", phase="request") == 1
    assert delta("cachewitness_sidecar_overhead_seconds_count", phase="response") == 1
    assert after.value("cachewitness_request_duration_seconds_sum", route="/v1/models") > 0


async def test_unlisted_path_is_counted_under_route_other(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """A request for any other path lands on route="other", never on its own path."""
    async with running_sim(fast("vllm")) as engine:
        url = await sidecar(engine)
        async with http.get(url + "/no/such/path/abc123") as resp:
            assert resp.status == 404
        result = await scrape(http, url)
    assert result.value("cachewitness_requests_total", route="other", code="4xx", served_by="aiohttp") == 1
    assert "/no/such/path/abc123" not in result.text


# --- tokens --------------------------------------------------------------------------------------


async def test_token_counters_move_by_exactly_the_usage_the_engine_reported(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """The same prompt twice: cached 0 then N; the counters' deltas equal the responses' usage."""
    async with running_sim(fast("vllm")) as engine:
        url = await sidecar(engine)
        before = await scrape(http, url)
        first = await post_chat(http, url, chat(PROMPT))
        second = await post_chat(http, url, chat(PROMPT))
        after = await scrape(http, url)
    cold, warm = (
        first["prompt_tokens_details"]["cached_tokens"],
        second["prompt_tokens_details"]["cached_tokens"],
    )
    assert cold == 0 and warm > 0

    def delta(name: str) -> float:
        """How much a sim-model sample moved between the two scrapes."""
        return after.value(name, model="sim-model") - before.value(name, model="sim-model")

    assert delta("cachewitness_prompt_tokens_total") == first["prompt_tokens"] + second["prompt_tokens"]
    assert delta("cachewitness_cached_tokens_total") == cold + warm
    assert delta("cachewitness_request_cached_tokens_count") == 2
    assert delta("cachewitness_request_cached_tokens_sum") == cold + warm
    assert delta("cachewitness_responses_without_cached_tokens_total") == 0
    # The cold answer lands in the le="0" bucket on its own.
    assert after.value("cachewitness_request_cached_tokens_bucket", model="sim-model", le="0.0") == 1


async def test_responses_without_cached_tokens_move_when_the_engine_reports_no_cached_field(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """vLLM without --enable-prompt-tokens-details: the response is counted (and its deprecated alias
    says the same), cached tokens stay put."""
    async with running_sim(fast("vllm", prompt_tokens_details=False)) as engine:
        url = await sidecar(engine)
        usage = await post_chat(http, url, chat(PROMPT))
        await post_chat(http, url, chat(PROMPT))
        result = await scrape(http, url)
    assert "prompt_tokens_details" not in usage
    assert result.value("cachewitness_responses_without_cached_tokens_total", model="sim-model") == 2
    assert result.value("cachewitness_cached_tokens_unknown_total", model="sim-model") == 2
    assert "Deprecated" in result.families["cachewitness_cached_tokens_unknown"].documentation
    assert result.value("cachewitness_cached_tokens_total", model="sim-model") == 0
    assert result.value("cachewitness_prompt_tokens_total", model="sim-model") == 2 * usage["prompt_tokens"]


async def test_failed_and_non_2xx_requests_are_not_responses_without_cached_tokens(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """The since-reset counters of /cache/state count, as the metric does, only 2xx responses
    without a cached field as `cached_tokens_unknown`: a rejected (400) request and one the
    client left mid-stream are requests, never "cached tokens unknown"."""
    async with running_sim(slow("vllm", prompt_tokens_details=False)) as engine:
        url = await sidecar(engine)
        async with http.post(url + "/cache/reset", json={"verify": "none"}) as resp:
            assert resp.status == 200
        await post_chat(http, url, chat(PROMPT))  # 2xx without a cached field: the one unknown
        async with http.post(url + "/v1/chat/completions", json={**chat(PROMPT), "max_tokens": -1}) as resp:
            assert resp.status == 400  # the engine rejects it: non-2xx
        stream = {**chat(PROMPT), "max_tokens": 2000, "stream": True}
        async with http.post(url + "/v1/chat/completions", json=stream) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the first event; then the client leaves: a failed exchange
        since = await _since_reset(http, url, requests=3)
        result = await scrape(http, url)
    assert since["cached_tokens_unknown"] == 1
    assert result.value("cachewitness_responses_without_cached_tokens_total", model="sim-model") == 1


async def _since_reset(http: aiohttp.ClientSession, url: str, *, requests: int) -> dict[str, Any]:
    """/cache/state's since_reset once it has counted `requests` (bounded: a request left by its
    client is counted when the sidecar sees it go)."""
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        async with http.get(url + "/cache/state") as resp:
            since: dict[str, Any] = (await resp.json())["since_reset"]
        if since["requests"] >= requests:
            return since
        assert asyncio.get_running_loop().time() < deadline, since
        await asyncio.sleep(0.05)


async def test_model_label_stays_within_the_engines_models_and_other(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """200 distinct request `model` values: labels are only the engine's listed id and "other"."""
    async with running_sim(fast("vllm")) as engine:
        url = await sidecar(engine)
        for index in range(200):
            await post_chat(http, url, chat(f"hello {index}", model=f"client-chosen-{index}"))
        await post_chat(http, url, chat("hello", model="sim-model"))
        result = await scrape(http, url)
    for name in MODEL_FAMILIES:
        assert result.label_values(name, "model") == {"sim-model", "other"}, name
    assert result.value("cachewitness_request_cached_tokens_count", model="other") == 200
    assert result.value("cachewitness_request_cached_tokens_count", model="sim-model") == 1


async def test_configured_allow_list_replaces_the_engines_models(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """metrics_models set: those names (and "other") are the only model labels, whatever the engine lists."""
    async with running_sim(fast("vllm")) as engine:
        url = await sidecar(engine, metrics_models=("alpha", "beta"))
        await post_chat(http, url, chat("one", model="beta"))
        await post_chat(http, url, chat("two", model="sim-model"))
        result = await scrape(http, url)
    assert result.label_values("cachewitness_prompt_tokens_total", "model") == {"alpha", "beta", "other"}
    assert result.value("cachewitness_request_cached_tokens_count", model="beta") == 1
    assert result.value("cachewitness_request_cached_tokens_count", model="other") == 1


async def test_metrics_max_models_bounds_the_engines_models(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """metrics_max_models=0: even the engine's own model is counted as "other"."""
    async with running_sim(fast("vllm")) as engine:
        url = await sidecar(engine, metrics_max_models=0)
        await post_chat(http, url, chat("one"))
        result = await scrape(http, url)
    assert result.label_values("cachewitness_prompt_tokens_total", "model") == {"other"}


async def test_model_ids_are_learnt_at_a_scrape_once_the_engine_is_up(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """Engine down at start (no ids known): the first scrape after it comes up learns its model."""
    upstream = closed_port_url()
    url = await sidecar(upstream)
    assert (await scrape(http, url)).label_values("cachewitness_prompt_tokens_total", "model") == {"other"}
    runner = web.AppRunner(build_sim_app(fast("vllm")), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", int(upstream.rsplit(":", 1)[1])).start()
        learnt = await scrape(http, url)
        await post_chat(http, url, chat("hello"))
        counted = await scrape(http, url)
    finally:
        await runner.cleanup()
    assert learnt.label_values("cachewitness_prompt_tokens_total", "model") == {"sim-model", "other"}
    assert counted.value("cachewitness_request_cached_tokens_count", model="sim-model") == 1


# --- the merge with the engine's /metrics --------------------------------------------------------


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "llamacpp"])
async def test_merged_exposition_parses_with_the_engines_families(
    dialect: str, sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """The sidecar's text followed by the engine's parses, carries both, and names no family twice."""
    async with running_sim(fast(dialect)) as engine:
        url = await sidecar(engine)
        await post_chat(http, url, chat(PROMPT))
        result = await scrape(http, url)
    assert result.value("cachewitness_upstream_metrics_up") == 1
    assert f"{dialect}:prompt_tokens_total" in result.names()
    types = result.type_lines()
    assert len(types) == len(set(types))


async def test_concurrent_scrapes_share_one_engine_fetch(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """N scrapes at once cost the engine one /metrics fetch, counted at the simulator."""
    async with sim_client(fast("vllm")) as engine:
        url = await sidecar(engine.url)
        scrapes = await asyncio.gather(*(scrape(http, url) for _ in range(50)))
        stats = await engine.stats()
    assert [s.value("cachewitness_upstream_metrics_up") for s in scrapes] == [1] * 50
    assert all("vllm:prompt_tokens_total" in s.names() for s in scrapes)
    assert stats["metrics_scrapes_total"] == 1


async def test_engine_text_is_fetched_again_once_older_than_a_second(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """A scrape after the reuse window asks the engine again (reuse is bounded, not forever)."""
    async with sim_client(fast("vllm")) as engine:
        url = await sidecar(engine.url)
        await scrape(http, url)
        await scrape(http, url)
        assert (await engine.stats())["metrics_scrapes_total"] == 1
        await asyncio.sleep(ENGINE_METRICS_MAX_AGE_S + 0.1)  # the window itself is what is tested
        await scrape(http, url)
        assert (await engine.stats())["metrics_scrapes_total"] == 2


@pytest.mark.parametrize("dialect", ["openai", "mindnano"])
async def test_engine_without_metrics_leaves_the_sidecars_and_says_so(
    dialect: str, sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """An engine whose /metrics is 404: the sidecar's metrics alone, upstream_metrics_up 0."""
    async with running_sim(fast(dialect)) as engine:
        url = await sidecar(engine)
        result = await scrape(http, url)
    assert result.value("cachewitness_upstream_metrics_up") == 0
    assert result.value("cachewitness_upstream_up") == 1
    assert all(name.startswith("cachewitness_") for name in result.names())


async def test_engine_down_still_serves_the_sidecars_metrics(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """No engine at all: /metrics answers 200 with the sidecar's families, both up gauges 0."""
    url = await sidecar(closed_port_url())
    result = await scrape(http, url)
    assert result.value("cachewitness_upstream_metrics_up") == 0
    assert result.value("cachewitness_upstream_up") == 0
    assert result.value("cachewitness_engine_info", kind="unknown", version="") == 1
    assert all(name.startswith("cachewitness_") for name in result.names())


async def test_engine_down_counts_a_connection_error(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """A request the engine cannot take: 502, counted as upstream_errors{kind="connection"} and code 5xx."""
    url = await sidecar(closed_port_url())
    async with http.post(url + "/v1/chat/completions", json=chat("hi")) as resp:
        assert resp.status == 502
    result = await scrape(http, url)
    assert result.value("cachewitness_upstream_errors_total", kind="connection") == 1
    assert (
        result.value(
            "cachewitness_requests_total", route="/v1/chat/completions", code="5xx", served_by="front"
        )
        == 1
    )
    assert result.value("cachewitness_cached_tokens_unknown_total", model="other") == 0


async def test_openmetrics_engine_text_loses_its_eof_and_colliding_families(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """An engine answering OpenMetrics with `# EOF` and a cachewitness_* family: both dropped from the merge."""
    body = (
        b"# HELP engine_queue_depth Requests waiting.\n"
        b"# TYPE engine_queue_depth gauge\n"
        b"# UNIT engine_queue_depth requests\n"
        b"engine_queue_depth 3\n"
        b"# HELP cachewitness_requests_total Not ours.\n"
        b"# TYPE cachewitness_requests_total counter\n"
        b'cachewitness_requests_total{route="x",code="2xx"} 99\n'
        b"# EOF"
    )
    async with engine_serving_metrics(
        body, "application/openmetrics-text; version=1.0.0; charset=utf-8"
    ) as engine:
        url = await sidecar(engine, engine="none")
        result = await scrape(http, url)
    assert result.value("engine_queue_depth") == 3
    assert result.value("cachewitness_upstream_metrics_up") == 1
    assert "# EOF" not in result.text
    assert "x" not in result.label_values("cachewitness_requests_total", "route")
    types = result.type_lines()
    assert len(types) == len(set(types))


async def test_engine_answering_metrics_with_html_is_not_merged(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """A server that answers /metrics with a web page: nothing merged, upstream_metrics_up 0."""
    async with engine_serving_metrics(b"<html><body>chat ui</body></html>", "text/html") as engine:
        url = await sidecar(engine, engine="none")
        result = await scrape(http, url)
    assert result.value("cachewitness_upstream_metrics_up") == 0
    assert "<html>" not in result.text


@pytest.mark.parametrize(
    "body",
    [
        b'[{"iter": 3, "numActiveRequests": 0, "kvCacheStats": {"reusedBlocks": 2}}]',  # TensorRT-LLM /metrics
        b"<html><body>chat ui</body></html>",
        b"engine_queue_depth 3\nnot a sample line\n",
    ],
)
async def test_engine_text_that_is_not_the_exposition_format_is_not_merged_even_as_text_plain(
    sidecar: SidecarFactory, http: aiohttp.ClientSession, body: bytes
) -> None:
    """Whatever the engine's label says, a body with a line that is no sample or comment stays out."""
    async with engine_serving_metrics(body, "text/plain; version=0.0.4") as engine:
        url = await sidecar(engine, engine="none")
        result = await scrape(http, url)  # parses the whole exposition as Prometheus does
    assert result.value("cachewitness_upstream_metrics_up") == 0
    assert "engine_queue_depth" not in result.text


# --- resets, verdicts, evidence ------------------------------------------------------------------


async def test_reset_is_counted_by_engine_and_answer(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """POST /cache/reset acknowledged by vLLM: one reset, one duration and one attempts observation."""
    async with running_sim(fast("vllm")) as engine:
        url = await sidecar(engine)
        async with http.post(url + "/cache/reset", json={"retry_seconds": 0}) as resp:
            assert resp.status == 200
            assert (await resp.json())["answer"] == "acknowledged"
        result = await scrape(http, url)
    assert result.value("cachewitness_cache_resets_total", engine="vllm", answer="acknowledged") == 1
    assert result.value("cachewitness_cache_reset_duration_seconds_count") == 1
    assert result.value("cachewitness_cache_reset_attempts_count") == 1
    assert result.value("cachewitness_cache_reset_attempts_sum") == 1


async def test_reset_answered_counts_and_bounds_its_labels(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """reset_answered: counted under its engine and answer; unknown words land on "other"."""
    async with running_sim(fast("vllm")) as engine, serve_sidecar(engine, tmp_path) as sidecar:
        app, url = sidecar.app, sidecar.url
        app[METRICS].reset_answered("vllm", "refused", 1.5, 3)
        app[METRICS].reset_answered("some-new-engine", "maybe", 0.2, 1)
        result = await scrape(http, url)
    assert result.value("cachewitness_cache_resets_total", engine="vllm", answer="refused") == 1
    assert result.value("cachewitness_cache_resets_total", engine="other", answer="other") == 1
    assert result.value("cachewitness_cache_reset_duration_seconds_count") == 2
    assert result.value("cachewitness_cache_reset_duration_seconds_bucket", le="2.5") == 2
    assert result.value("cachewitness_cache_reset_duration_seconds_bucket", le="1.0") == 1
    assert result.value("cachewitness_cache_reset_attempts_sum") == 4


async def test_verdict_of_a_reset_is_counted(sidecar: SidecarFactory, http: aiohttp.ClientSession) -> None:
    """A reset, then a cold request: one `consistent` verdict."""
    async with running_sim(fast("vllm")) as engine:
        url = await sidecar(engine)
        await post_chat(http, url, chat(PROMPT))
        async with http.post(url + "/cache/reset", json={"retry_seconds": 0}) as resp:
            assert resp.status == 200
        usage = await post_chat(http, url, chat(PROMPT))
        result = await scrape(http, url)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert result.value("cachewitness_cache_verifications_total", verdict="consistent") == 1
    assert result.value("cachewitness_cache_verifications_total", verdict="contradicted") == 0


async def test_evidence_records_are_counted_as_the_writer_wrote_them(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """After the writer flushed one observation, evidence_records_total says 1 for its event type."""
    async with running_sim(fast("vllm")) as engine, serve_sidecar(engine, tmp_path) as sidecar:
        app, url = sidecar.app, sidecar.url
        await post_chat(http, url, chat(PROMPT))
        await app[EVIDENCE].flush()
        result = await scrape(http, url)
    assert result.value("cachewitness_evidence_records_total", event_type="infer.cache_observation") == 1
    assert result.value("cachewitness_evidence_write_errors_total") == 0


# --- the dashboard -------------------------------------------------------------------------------


def dashboard_exprs() -> list[str]:
    """Every PromQL expression in the dashboard (panel targets and query variables)."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [
        variable["definition"] for variable in dashboard["templating"]["list"] if "definition" in variable
    ]
    return exprs


def test_dashboard_has_the_standard_schema_fields() -> None:
    """Title, uid, schema version, time, a datasource variable, and panels placed on the grid with queries."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    for key in ("title", "uid", "schemaVersion", "time", "templating", "panels"):
        assert key in dashboard, key
    assert any(
        v["type"] == "datasource" and v["name"] == "datasource" for v in dashboard["templating"]["list"]
    )
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"] and all(target["expr"] for target in panel["targets"])


async def test_dashboard_queries_only_metrics_a_real_scrape_has(
    sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """Every cachewitness_* name in the dashboard is a sample name of a real scrape."""
    referenced = {name for expr in dashboard_exprs() for name in re.findall(r"\bcachewitness_[a-z_]+", expr)}
    async with running_sim(fast("vllm")) as engine:
        url = await sidecar(engine)
        result = await scrape(http, url)
    assert len(referenced) > 15
    assert sorted(referenced - result.names()) == []


def test_dashboard_covers_the_telemetry_ops_asked_for() -> None:
    """Hit ratio, resets, verdicts, TTFB/duration quantiles, in-flight/draining, errors and overhead are shown."""
    text = "\n".join(dashboard_exprs())
    for needle in (
        "rate(cachewitness_cached_tokens_total",
        "rate(cachewitness_prompt_tokens_total",
        "cachewitness_cache_resets_total",
        "cachewitness_cache_verifications_total",
        "histogram_quantile(0.95, sum by (le, route) (rate(cachewitness_time_to_first_byte_seconds_bucket",
        "histogram_quantile(0.95, sum by (le, route) (rate(cachewitness_request_duration_seconds_bucket",
        "cachewitness_inflight_requests",
        "cachewitness_draining",
        "cachewitness_upstream_errors_total",
        "histogram_quantile(0.99, sum by (le, direction) (rate(cachewitness_added_seconds_bucket",
    ):
        assert needle in text, needle
