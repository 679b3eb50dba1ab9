"""`cachewitness report` as a user runs it: the page from a sidecar or from evidence files.

The page's case table is read back with the standard library's HTML parser and compared with
the evidence records, computed from the raw records (tests/report_session.py). The page in a
real browser: tests/test_report_browser.py.
"""

from __future__ import annotations

import io
import tarfile
from html.parser import HTMLParser
from pathlib import Path

from tests.support.cli import cli
from tests.support.report_session import (
    OTHER_SESSION,
    SESSION,
    expected_rows,
    hostile_evidence,
    session_records,
    session_run,
)
from tests.support.sidecar import closed_port_url, stack
from tests.support.sim import chat, fast, words


class _Page(HTMLParser):
    """The case table's body rows, and every URL-bearing attribute and script element seen."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.urls: list[str] = []
        self.scripts = 0
        self.csp: str | None = None
        self._in_body = False
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        self.urls += [v for k, v in attrs if k in ("src", "href", "action") and v]
        if tag == "script":
            self.scripts += 1
        if tag == "meta" and named.get("http-equiv") == "Content-Security-Policy":
            self.csp = named.get("content")
        if tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body:
            self.rows.append([])
        elif tag == "td" and self._in_body:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "tbody":
            self._in_body = False
        elif tag == "td" and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def read_page(path: Path) -> _Page:
    """The page parsed."""
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


async def test_report_from_the_sidecar_is_the_sessions_cases_as_the_evidence_says(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    async with session_run(tmp_path) as run:
        result = await cli("report", "--url", run.url, "--session-id", SESSION, "-o", str(out))
    assert result.code == 0, result.stderr
    assert result.stdout.startswith(f"cachewitness report: {out}: 2 cases, 5 requests, 2 resets")
    page = read_page(out)
    vllm_files = run.files[2:]
    assert {row[0]: row for row in page.rows} == expected_rows(session_records(vllm_files), SESSION)
    assert [row[2] for row in page.rows] == ["verified", "verified"]
    assert [row[3] for row in page.rows] == ["consistent", "consistent"]
    # cold-1's sequence was closed by cold-2's reset: the engine's counters say nothing bypassed the sidecar.
    assert {row[0]: row[9] for row in page.rows}["cold-1"] == "0 requests, 0 cached tokens"


async def test_report_from_evidence_files_merges_them_and_leaves_other_sessions_out(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    async with session_run(tmp_path) as run:
        pass  # every sidecar closed: its evidence is all on disk
    files = [str(path) for path in run.files]
    result = await cli("report", "--from-evidence", *files, "--session-id", SESSION, "-o", str(out))
    assert result.code == 0, result.stderr
    page = read_page(out)
    rows = {row[0]: row for row in page.rows}
    assert rows == expected_rows(session_records(run.files), SESSION)
    assert rows["ram-cache"][2:5] == [
        "contradicted",
        "contradicted",
        "canary contradicted, counters consistent",
    ]
    assert OTHER_SESSION not in out.read_text()


async def test_the_page_loads_nothing_and_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    async with session_run(tmp_path) as run:
        pass
    result = await cli(
        "report", "--from-evidence", *map(str, run.files), "--session-id", SESSION, "-o", str(out)
    )
    assert result.code == 0, result.stderr
    page = read_page(out)
    assert page.urls == [] and page.scripts == 0
    assert page.csp == "default-src 'none'; style-src 'unsafe-inline'"
    # One dot per request with a cached count in the first plot, one per request in the second.
    text = out.read_text()
    assert text.count('<circle class="tokens"') == 7
    assert sum(text.count(f'<circle class="{heat}"') for heat in ("cold", "warm", "unknown")) == 7


async def test_markup_in_ids_is_shown_as_text(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    evidence = hostile_evidence(tmp_path / "hostile.jsonl")
    result = await cli(
        "report", "--from-evidence", str(evidence), "--session-id", "s<b>1</b>", "-o", str(out)
    )
    assert result.code == 0, result.stderr
    page = read_page(out)
    assert page.scripts == 0 and page.urls == []
    assert page.rows[0][0] == '<script>alert("x")</script><img src=x onerror=alert(1)>'


async def test_a_session_without_records_is_bad_input_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    evidence = hostile_evidence(tmp_path / "hostile.jsonl")
    result = await cli("report", "--from-evidence", str(evidence), "--session-id", "nope", "-o", str(out))
    assert result.code == 2
    assert "no evidence records for session 'nope'" in result.stderr and "--session-id" in result.stderr
    assert not out.exists()


async def test_an_unreadable_evidence_file_is_bad_input(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    result = await cli(
        "report", "--from-evidence", str(missing), "--session-id", "s", "-o", str(tmp_path / "r")
    )
    assert result.code == 2
    assert f"cannot read --from-evidence {missing}: No such file or directory" in result.stderr


async def test_no_sidecar_at_url_exits_8(tmp_path: Path) -> None:
    url = closed_port_url()
    result = await cli("report", "--url", url, "--session-id", "s", "-o", str(tmp_path / "r.html"))
    assert result.code == 8
    assert f"the sidecar at {url} cannot be reached" in result.stderr


async def test_report_from_a_run_bundle_shows_the_session_and_says_the_chains_are_whole(
    tmp_path: Path,
) -> None:
    bundle, out = tmp_path / "run.tar.gz", tmp_path / "report.html"
    async with session_run(tmp_path) as run:
        made = await cli("evidence", "bundle", "--url", run.url, "--session-id", SESSION, "-o", str(bundle))
    assert made.code == 0, made.stderr
    result = await cli("report", "--from-bundle", str(bundle), "--session-id", SESSION, "-o", str(out))
    assert result.code == 0, result.stderr
    page = read_page(out)
    vllm_files = run.files[2:]
    assert {row[0]: row for row in page.rows} == expected_rows(session_records(vllm_files), SESSION)
    assert f"Records from bundle {bundle}, every chain whole (" in out.read_text()


async def test_report_from_a_bad_bundle_is_bad_input(tmp_path: Path) -> None:
    not_a_bundle = hostile_evidence(tmp_path / "hostile.jsonl")
    result = await cli(
        "report", "--from-bundle", str(not_a_bundle), "--session-id", "s", "-o", str(tmp_path / "r")
    )
    assert result.code == 2 and "is not a readable bundle" in result.stderr


def _tampered(bundle: Path, out: Path) -> Path:
    """The bundle with one cached-token count raised in its records (its proof no longer holds;
    each record is carried as a JSON string in its proof, so its quotes are escaped)."""
    with tarfile.open(bundle, "r:*") as source, tarfile.open(out, "w:gz") as target:
        for info in source:
            data = source.extractfile(info).read() if info.isfile() else b""  # type: ignore[union-attr]  # a file has a reader
            if info.name.startswith(("pods/", "proofs/")) and b'\\"cached_tokens\\":400' in data:
                data = data.replace(b'\\"cached_tokens\\":400', b'\\"cached_tokens\\":401', 1)
            info.size = len(data)
            target.addfile(info, io.BytesIO(data))
    return out


async def test_report_of_an_edited_bundle_says_its_chain_is_not_whole(tmp_path: Path) -> None:
    bundle, out = tmp_path / "run.tar.gz", tmp_path / "report.html"
    async with session_run(tmp_path) as run:
        made = await cli("evidence", "bundle", "--url", run.url, "--session-id", SESSION, "-o", str(bundle))
    assert made.code == 0, made.stderr
    edited = _tampered(bundle, tmp_path / "edited.tar.gz")
    result = await cli("report", "--from-bundle", str(edited), "--session-id", SESSION, "-o", str(out))
    assert result.code == 0, result.stderr
    assert f"Records from bundle {edited}, NOT whole: " in out.read_text()


class _Circles(HTMLParser):
    """Every plotted request: its classes and its title."""

    def __init__(self) -> None:
        super().__init__()
        self.circles: list[tuple[str, str]] = []
        self._class: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "circle":
            self._class = dict(attrs).get("class") or ""

    def handle_data(self, data: str) -> None:
        if self._class is not None:
            self.circles.append((self._class, data))
            self._class = None


async def test_isolated_requests_are_marked_cold_or_contradicted(tmp_path: Path) -> None:
    """Each isolated request's point is ringed, a contradicted one in red, its title says its result."""
    tags = {"X-Session-Id": "iso", "X-Case-Id": "c1", "X-Cachewitness-Isolation": "request"}
    out = tmp_path / "report.html"
    async with stack(fast("vllm", ignore_isolation=True), tmp_path) as s:
        for headers in (tags, tags, {"X-Session-Id": "iso", "X-Case-Id": "c1"}):
            async with s.http.post(
                f"{s.url}/v1/chat/completions", json=chat(words(40), 2), headers=headers
            ) as r:
                assert r.status == 200
        result = await cli("report", "--url", s.url, "--session-id", "iso", "-o", str(out))
    assert result.code == 0, result.stderr
    page = _Circles()
    page.feed(out.read_text(encoding="utf-8"))
    ttft = [(css, title) for css, title in page.circles if "tokens" not in css]
    assert [css for css, _ in ttft] == ["cold isolated", "warm isolated contradicted", "warm"]
    # The isolation mark ends the title's first part; the sidecar's added time (issue 50) follows it.
    assert [title.split("; ", 1)[0].rsplit(", ", 1)[-1] for _, title in ttft][:2] == [
        "isolated: cold",
        "isolated: contradicted",
    ]
