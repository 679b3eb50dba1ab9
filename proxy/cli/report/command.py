"""`cachewitness report`: one session's evidence as one self-contained HTML page.

The records come from a sidecar (`--url`, `GET /cache/evidence?session_id=S`), from a run bundle
(`--from-bundle FILE`, `cachewitness evidence bundle`: its chains are checked and the page says
whether they are whole) or from evidence files on disk (`--from-evidence FILE…`).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from proxy.cli.http import (
    EXIT_BAD_INPUT,
    OPENER,
    BadOption,
    admin_request,
    common_arguments,
    http_failure,
    sidecar_target,
    unreachable,
)
from proxy.cli.report.data import build_report
from proxy.cli.report.page import render_page
from proxy.evidence.bundle import BundleError, read_bundle, verify_bundle
from proxy.redact import redact_url
from proxy.vocabulary import EventType

__all__ = ["add_report_arguments", "run_report"]


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `cachewitness report`."""
    common_arguments(parser)
    parser.add_argument("--session-id", required=True, metavar="S", help="the benchmark session to report")
    parser.add_argument(
        "-o",
        "--output",
        default="report.html",
        metavar="FILE",
        help="where to write the page (default report.html)",
    )
    sources = parser.add_mutually_exclusive_group()
    sources.add_argument(
        "--from-bundle",
        default=None,
        metavar="FILE",
        help="read a run bundle (cachewitness evidence bundle) instead of asking the sidecar at --url",
    )
    sources.add_argument(
        "--from-evidence",
        nargs="+",
        default=None,
        metavar="FILE",
        help="read these evidence files (JSON lines) instead of asking the sidecar at --url",
    )


class _BadInput(Exception):
    """Input the report cannot use: said in one line, exit 2."""


def _lines_records(lines: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    """JSON objects of a JSON-lines stream; other lines (a torn last write, foreign text) are skipped."""
    for line in lines:
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("event_type") != EventType.CLUSTER_READ:
            yield record


def _file_records(paths: list[str]) -> list[dict[str, Any]]:
    """Every record of the given files, in file order."""
    records: list[dict[str, Any]] = []
    for path in paths:
        try:
            with open(path, "rb") as handle:
                records.extend(_lines_records(iter(handle.readline, b"")))
        except OSError as exc:
            raise _BadInput(f"cannot read --from-evidence {path}: {exc.strerror or exc}") from exc
    return records


def _bundle_records(path: str) -> tuple[list[dict[str, Any]], str]:
    """Every record of a run bundle's chain segments, and what its check found (one line)."""
    try:
        bundle = read_bundle(Path(path))
        reports, problems = verify_bundle(bundle, None)  # a malformed proof is bad input too
    except BundleError as exc:
        raise _BadInput(str(exc)) from exc
    records = [
        record
        for chains in bundle.pods.values()
        for lines in chains.values()
        for record in _lines_records(iter(lines))
    ]
    broken = [report.name for report in reports if not report.whole] + problems
    count = sum(report.records for report in reports)
    check = f"every chain whole ({count} records)" if not broken else f"NOT whole: {'; '.join(broken)}"
    return records, f"bundle {path}, {check}"


def _sidecar_records(ns: argparse.Namespace, base: str, token: str | None) -> list[dict[str, Any]]:
    """The session's records from the sidecar's /cache/evidence (raises urllib's errors)."""
    query = {"session_id": ns.session_id}
    if ns.scope == "cluster":
        query["scope"] = "cluster"
    url = f"{base}/cache/evidence?{urllib.parse.urlencode(query)}"
    with OPENER.open(admin_request(url, token), timeout=ns.timeout) as response:
        return list(_lines_records(iter(response.readline, b"")))


def _write(path: str, page: str) -> None:
    """Write the page whole: into a temporary file beside it, then renamed over it."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial")
    try:
        partial.write_text(page, encoding="utf-8")
        os.replace(partial, target)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise _BadInput(f"cannot write {path}: {exc.strerror or exc}") from exc


def run_report(ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    """Fetch or read the records, write the page; 0, or 2 bad input / 6, 8, 9 as `evidence` (EXIT_*)."""
    env = os.environ if env is None else env
    try:
        if ns.from_bundle:
            records, source = _bundle_records(ns.from_bundle)
        elif ns.from_evidence:
            records = _file_records(ns.from_evidence)
            source = ", ".join(ns.from_evidence)
        else:
            try:
                base, token = sidecar_target(ns, env)
            except BadOption as bad:
                raise _BadInput(str(bad)) from bad
            source = redact_url(base)
            try:
                records = _sidecar_records(ns, base, token)
            except urllib.error.HTTPError as exc:
                return http_failure("report", exc.code, exc.read(), f"{base}/cache/evidence")
            except (OSError, ValueError) as exc:
                return unreachable("report", base, exc)
        data = build_report(records, ns.session_id)
        if not data.cases:
            raise _BadInput(
                f"no evidence records for session {ns.session_id!r} in {source}; check --session-id "
                "(the X-Session-Id your benchmark sends, or the reset's session_id)"
            )
        _write(ns.output, render_page(data, source=source))
    except _BadInput as exc:
        print(f"cachewitness report: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(
        f"cachewitness report: {ns.output}: {len(data.cases)} cases, {len(data.requests)} requests, "
        f"{len(data.resets)} resets"
    )
    return 0
