"""The chart's alerts, run by promtool: valid rules, and each alert fires on its series and only on them.

The cases are tests/alerts.test.yaml (promtool's unit-test format); the rules are the chart's
PrometheusRule as rendered. promtool's cases carry their own series, so a metric renamed in the
sidecar but not in an alert fails elsewhere: tests/test_helm_cluster.py checks each alert's
selectors against a real scrape, and tests/test_prometheus_live.py runs them on a real one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.helm import TOOLS_PYTHON
from tests.support.prometheus import PROMTOOL, alerts, require, rule_groups, write_rules

CASES = Path(__file__).resolve().parent / "alerts.test.yaml"
YAML_TO_JSON = "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))"


@pytest.fixture(autouse=True)
def promtool() -> None:
    """Skip with the reason where the install script could not fetch promtool."""
    require(PROMTOOL)


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """promtool with these arguments (bounded)."""
    return subprocess.run(
        [str(PROMTOOL), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def cases() -> list[dict[str, Any]]:
    """The unit-test groups of tests/alerts.test.yaml (parsed by the tools venv's PyYAML)."""
    parsed = subprocess.run(
        [str(TOOLS_PYTHON), "-c", YAML_TO_JSON],
        input=CASES.read_text(encoding="utf-8"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    groups: list[dict[str, Any]] = json.loads(parsed.stdout)["tests"]
    return groups


def test_rendered_rules_pass_promtool_check(tmp_path: Path) -> None:
    """promtool check rules: every expression parses and every rule is well formed."""
    rules = write_rules(tmp_path, rule_groups())
    result = run_promtool("check", "rules", str(rules), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts(rule_groups()))} rules found" in result.stdout


def test_every_alert_fires_on_its_series_and_stays_quiet_on_the_others(tmp_path: Path) -> None:
    """promtool test rules on tests/alerts.test.yaml against the rendered rules."""
    write_rules(tmp_path, rule_groups())
    shutil.copy(CASES, tmp_path / CASES.name)
    result = run_promtool("test", "rules", CASES.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    """Each alert of the chart: at least one case expecting it to fire and one expecting silence."""
    firing: set[str] = set()
    quiet: set[str] = set()
    for group in cases():
        for check in group["alert_rule_test"]:
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    names = set(alerts(rule_groups()))
    assert len(names) >= 11
    assert sorted(names - firing) == [], "alerts without a firing case"
    assert sorted(names - quiet) == [], "alerts without a quiet case"
    assert sorted((firing | quiet) - names) == [], "cases for alerts the chart does not have"
