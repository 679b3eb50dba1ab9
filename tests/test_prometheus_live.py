"""A real Prometheus scrapes a real sidecar while a session runs; every dashboard query and alert is evaluated.

The sidecar (`python -m proxy serve`) fronts the llama.cpp simulator with its RAM prompt cache,
where a slot erase leaves the cache warm, so the canary contradicts a reset as it does on a real
llama-server without `--cache-ram 0`. The alerts are the chart's rendered PrometheusRule, loaded
into that Prometheus as an operator's would be.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.sim import running_sim
from tests.support.client import CLIENT_TIMEOUT
from tests.support.process import start_sidecar
from tests.support.prometheus import (
    PROMETHEUS,
    Prometheus,
    QueryError,
    alerts,
    dashboard_queries,
    dashboard_variable_metrics,
    require,
    rule_groups,
    running_prometheus,
    write_rules,
)
from tests.support.sim import chat, fast, words

CONTRADICTED = 'cachewitness_cache_resets_total{answer="contradicted"}'


@pytest.fixture(autouse=True)
def prometheus_installed() -> None:
    """Skip with the reason where the install script could not fetch Prometheus."""
    require(PROMETHEUS)


async def _chat(http: aiohttp.ClientSession, url: str, content: str, stream: bool) -> None:
    """One chat completion through the sidecar, read to its end (streams ask for usage)."""
    body: dict[str, Any] = chat(content, 4)
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        await resp.read()


async def _reset(http: aiohttp.ClientSession, url: str, **body: Any) -> str:
    """POST /cache/reset; the answer word."""
    async with http.post(f"{url}/cache/reset", data=orjson.dumps({"retry_seconds": 0, **body})) as resp:
        answer: str = (await resp.json())["answer"]
        return answer


async def _session(url: str) -> list[str]:
    """Requests and streams around two resets: one without a canary, one the canary contradicts."""
    prompt = words(80)
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
        for index in range(3):
            await _chat(http, url, prompt, stream=index % 2 == 1)
        answers = [await _reset(http, url, verify="none", session_id="s", case_id="c1")]
        await _chat(http, url, prompt, stream=True)
        await _chat(http, url, prompt, stream=False)
        answers.append(await _reset(http, url, session_id="s", case_id="c2"))
        await _chat(http, url, prompt, stream=False)
        await _chat(http, url, words(40, "beta"), stream=True)
    return answers


async def _rules_evaluated(prometheus: Prometheus, bound_s: float = 30.0) -> list[dict[str, Any]]:
    """The loaded alerting rules once each has been evaluated after the session (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while True:
        groups = (await prometheus.api("rules", type="alert"))["groups"]
        rules: list[dict[str, Any]] = [rule for group in groups for rule in group["rules"]]
        firing = {alert["labels"]["alertname"] for rule in rules for alert in rule.get("alerts", [])}
        if "CachewitnessResetContradicted" in firing:
            return rules
        assert loop.time() < deadline, f"CachewitnessResetContradicted never fired; rules: {rules}"
        await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_every_panel_and_alert_evaluates_on_a_real_scrape(tmp_path: Path) -> None:
    spec = rule_groups()
    rules_file = write_rules(tmp_path, spec)
    (tmp_path / "slots").mkdir()
    engine_config = fast("llamacpp", slot_save_path=str(tmp_path / "slots"), ram_cache=True)
    async with running_sim(engine_config) as engine:
        process, url = await start_sidecar(engine, tmp_path)
        try:
            target = url.removeprefix("http://")
            async with running_prometheus(tmp_path, target, rules_file) as prometheus:
                # The zero before the reset: increase() needs a sample on each side of it.
                await prometheus.wait_for(f"{CONTRADICTED} == 0")
                answers = await _session(url)
                await prometheus.wait_for(f"{CONTRADICTED} == 1")
                await prometheus.wait_for('sum(cachewitness_requests_total{code="2xx"}) >= 7')
                rules = await _rules_evaluated(prometheus)
                panels = {
                    query.panel: await _series_count(prometheus, query.expr) for query in dashboard_queries()
                }
                variables = {
                    metric: len(await prometheus.api("series", **{"match[]": metric}))
                    for metric in dashboard_variable_metrics()
                }
                alert_results = {
                    name: await _series_count(prometheus, expr) for name, expr in alerts(spec).items()
                }
                contradicted = await prometheus.query(alerts(spec)["CachewitnessResetContradicted"])
        finally:
            process.terminate()
            await asyncio.wait_for(process.wait(), timeout=30)
    assert answers == ["acknowledged", "contradicted"]
    assert [panel for panel, count in panels.items() if count <= 0] == [], panels
    assert len(panels) >= 20 and variables and all(variables.values()), variables
    assert [name for name, count in alert_results.items() if count < 0] == [], alert_results
    assert len(alert_results) == len(rules) >= 11
    assert [(rule["name"], rule["lastError"]) for rule in rules if rule["health"] != "ok"] == []
    (series,) = contradicted
    assert series["metric"] == {"namespace": "ns", "pod": "cw-0"}
    assert float(series["value"][1]) > 0


async def _series_count(prometheus: Prometheus, expr: str) -> int:
    """How many series an instant query returns; -1 (and the error, printed) when Prometheus refuses it."""
    try:
        return len(await prometheus.query(expr))
    except QueryError as error:
        print(error)
        return -1
