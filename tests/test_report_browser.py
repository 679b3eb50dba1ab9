"""The report page in a real headless Chromium: it loads with no error, asks for nothing, shows the evidence.

Chromium comes from scripts/install-browser.sh (`make test` runs it) or CACHEWITNESS_CHROMIUM;
without one these tests skip and say how to get it. The screenshot for a person to look at is
written to .cache/report/report.png.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.browser import REPO, BrowserPage, chromium_binary, open_page
from tests.support.cli import cli
from tests.support.report_session import (
    SESSION,
    expected_rows,
    hostile_evidence,
    session_records,
    session_run,
)

pytestmark = pytest.mark.slow

SCREENSHOT = REPO / ".cache" / "report" / "report.png"
ROWS_JS = (
    "[...document.querySelectorAll('#cases tbody tr')].map(tr => [...tr.cells].map(td => td.textContent))"
)


def _binary() -> str:
    binary = chromium_binary()
    if binary is None:
        pytest.skip(
            "no headless chromium here: run scripts/install-browser.sh (make test does) "
            "or set CACHEWITNESS_CHROMIUM to a chromium binary"
        )
    return binary


async def _count(page: BrowserPage, selector: str) -> int:
    return int(await page.evaluate(f"document.querySelectorAll({selector!r}).length"))


async def test_the_report_loads_in_chromium_with_no_error_and_shows_the_evidence(tmp_path: Path) -> None:
    binary = _binary()
    out = tmp_path / "report.html"
    async with session_run(tmp_path) as run:
        pass
    result = await cli(
        "report", "--from-evidence", *map(str, run.files), "--session-id", SESSION, "-o", str(out)
    )
    assert result.code == 0, result.stderr
    records = session_records(run.files)
    async with open_page(binary) as page:
        await page.load(out.as_uri())
        rows = await page.evaluate(ROWS_JS)
        cached_dots = await _count(page, "#cached-plot circle")
        ttft_dots = await _count(page, "#ttft-plot circle")
        cold = await _count(page, "#ttft-plot circle.cold")
        reset_lines = await _count(page, "#cached-plot g.reset line")
        session = await page.evaluate("document.getElementById('session').textContent")
        shot = await page.screenshot(SCREENSHOT)
    assert page.errors() == []
    assert page.requests == [out.as_uri()]  # the page itself, and nothing else
    assert session == SESSION
    assert {row[0]: row for row in rows} == expected_rows(records, SESSION)
    mine = [r for r in records if r.get("session_id") == SESSION]
    observations = [r for r in mine if r["event_type"] == "infer.cache_observation"]
    assert cached_dots == ttft_dots == len(observations) == 7
    # Each case's first request after its reset is cold, except where the reset was contradicted.
    assert cold == sum(1 for r in observations if r["cached_tokens"] == 0) == 2
    assert reset_lines == sum(1 for r in mine if r["event_type"] == "infer.cache_state") == 3
    assert shot.stat().st_size > 10_000, shot


async def test_markup_in_ids_runs_nothing_in_chromium(tmp_path: Path) -> None:
    binary = _binary()
    out = tmp_path / "report.html"
    evidence = hostile_evidence(tmp_path / "hostile.jsonl")
    result = await cli(
        "report", "--from-evidence", str(evidence), "--session-id", "s<b>1</b>", "-o", str(out)
    )
    assert result.code == 0, result.stderr
    async with open_page(binary) as page:
        await page.load(out.as_uri())
        rows = await page.evaluate(ROWS_JS)
        images = await _count(page, "img")
    assert page.errors() == [] and page.requests == [out.as_uri()]
    assert images == 0 and page.console == []
    assert rows[0][0] == '<script>alert("x")</script><img src=x onerror=alert(1)>'
