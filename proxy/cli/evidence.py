"""`cachewitness evidence`: stream a sidecar's evidence records, or print a per-case summary (docs/cli.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from typing import IO, Any

from proxy.cli.cluster_report import unreadable_pods
from proxy.cli.http import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    OPENER,
    BadOption,
    admin_request,
    common_arguments,
    http_failure,
    sidecar_target,
    unreachable,
)
from proxy.evidence.summary import summarize, summary_table
from proxy.vocabulary import EventType

__all__ = ["add_evidence_arguments", "run_evidence"]


def add_evidence_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `cachewitness evidence`."""
    common_arguments(parser)
    parser.add_argument("--session-id", default=None, metavar="S")
    parser.add_argument("--case-id", default=None, metavar="C")
    parser.add_argument(
        "--event-type",
        default=None,
        metavar="T",
        help="infer.cache_state, infer.cache_observation or infer.cache_verification",
    )
    parser.add_argument(
        "--since-ns", type=int, default=None, metavar="NS", help="records at or after this time"
    )
    parser.add_argument(
        "--summary", action="store_true", help="print a table per (session, case) instead of the records"
    )


def _evidence_url(ns: argparse.Namespace, base: str) -> str:
    """GET /cache/evidence with the filters the user gave."""
    query = {
        name: str(value)
        for name, value in (
            ("session_id", ns.session_id),
            ("case_id", ns.case_id),
            ("event_type", ns.event_type),
            ("since_ns", ns.since_ns),
            ("scope", "cluster" if ns.scope == "cluster" else None),
        )
        if value is not None
    }
    return f"{base}/cache/evidence" + (f"?{urllib.parse.urlencode(query)}" if query else "")


def _records(lines: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    """Decode JSON lines, skipping any that are not JSON objects."""
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield record


def run_evidence(
    ns: argparse.Namespace, env: Mapping[str, str] | None = None, out: IO[bytes] | None = None
) -> int:
    """Stream GET /cache/evidence to stdout, or print a per-case summary table; 0, or 2/6/8/9 (EXIT_*)."""
    env = os.environ if env is None else env
    try:
        base, token = sidecar_target(ns, env)
    except BadOption as bad:
        print(f"cachewitness evidence: {bad}", file=sys.stderr)
        return EXIT_BAD_INPUT
    sink = out if out is not None else sys.stdout.buffer
    # With scope cluster, the last line names the pods that could not be read.
    trailers: list[dict[str, Any]] = []
    url = _evidence_url(ns, base)
    try:
        with OPENER.open(admin_request(url, token), timeout=ns.timeout) as response:
            if ns.summary:
                records = list(_records(iter(response.readline, b"")))
                trailers = [r for r in records if r.get("event_type") == EventType.CLUSTER_READ]
                cases = summarize(r for r in records if r.get("event_type") != EventType.CLUSTER_READ)
                sink.write(summary_table(cases).encode("utf-8") + b"\n")
            else:
                for line in iter(response.readline, b""):  # bounded by the response's end
                    sink.write(line)
                    if EventType.CLUSTER_READ.encode() in line:
                        trailers.extend(_records(iter([line])))
            sink.flush()
    except urllib.error.HTTPError as exc:
        return http_failure("evidence", exc.code, exc.read(), url)
    except BrokenPipeError:
        return 0  # the reader (e.g. `head`) has had enough
    except (OSError, ValueError) as exc:
        return unreachable("evidence", base, exc)
    missing = unreadable_pods(trailers)
    if missing:
        print(f"cachewitness evidence: pods not read: {'; '.join(missing)}", file=sys.stderr)
        return EXIT_FAILED
    return 0
