"""What `evidence bundle` and `evidence attest` share: a session's Merkle proofs, fetched from a
sidecar (`?proof=inclusion`), and the lines `verify` prints for each report (docs/cli.md)."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.cli.cluster_report import unreadable_pods
from proxy.cli.http import (
    EXIT_BAD_INPUT,
    OPENER,
    BadOption,
    admin_request,
    http_failure,
    sidecar_target,
    unreachable,
)
from proxy.evidence.proof_check import ProofReport
from proxy.evidence.tar_read import printable
from proxy.evidence.verify import ChainReport
from proxy.vocabulary import EventType

__all__ = ["EXIT_BROKEN", "Fetched", "fetch_proofs", "print_report"]

EXIT_BROKEN = 1  # a chain or proof not whole; pods that could not be read

# How the control lines of a proof answer start (orjson writes no spaces).
_POD = b'{"event_type":"cachewitness.proof_pod"'
_CLUSTER_READ = b'{"event_type":"cachewitness.cluster_read"'


@dataclass(frozen=True)
class Fetched:
    """Each pod's `?proof=inclusion` answer for the session, and where it came from."""

    base: str
    proofs: dict[str, list[bytes]]


def print_report(report: ChainReport | ProofReport) -> None:
    """One line per chain or proof, then each problem and note below it."""
    # Names and values come from the files: escaped, so none can rewrite what is printed around it.
    print(printable(report.summary_line()))
    for problem in report.problems:
        print(f"  broken: {printable(problem)}")
    for note in report.notes:
        print(f"  note: {printable(note)}")


def _split(lines: Iterator[bytes], pod: str) -> tuple[dict[str, list[bytes]], list[dict[str, Any]]]:
    """Each pod's answer (a cluster's is split at its `cachewitness.proof_pod` lines), and the
    cluster's trailer."""
    proofs: dict[str, list[bytes]] = {}
    trailers: list[dict[str, Any]] = []
    for line in lines:
        if line.startswith((_POD, _CLUSTER_READ)):
            record = orjson.loads(line)
            if record.get("event_type") == EventType.PROOF_POD:
                pod = str(record.get("pod"))
            else:
                trailers.append(record)
            continue
        proofs.setdefault(pod, []).append(line)
    return proofs, trailers


def fetch_proofs(command: str, ns: argparse.Namespace, env: Mapping[str, str]) -> Fetched | int:
    """The session's proofs from the sidecar `ns` names (every pod's with `--scope cluster`); an exit
    code, said on stderr, when they cannot be had."""
    try:
        base, token = sidecar_target(ns, env)
    except BadOption as bad:
        print(f"cachewitness evidence {command}: {bad}", file=sys.stderr)
        return EXIT_BAD_INPUT
    query = {"proof": "inclusion", "session_id": ns.session_id}
    if ns.scope == "cluster":
        query["scope"] = "cluster"
    url = f"{base}/cache/evidence?{urllib.parse.urlencode(query)}"
    try:
        with OPENER.open(admin_request(url, token), timeout=ns.timeout) as response:
            pod = urllib.parse.urlsplit(base).netloc.rpartition("@")[2]
            proofs, trailers = _split(iter(response.readline, b""), pod)
    except urllib.error.HTTPError as exc:
        return http_failure(f"evidence {command}", exc.code, exc.read(), url)
    except (OSError, ValueError) as exc:
        return unreachable(f"evidence {command}", base, exc)
    missing = unreadable_pods(trailers)
    if missing:
        print(f"cachewitness evidence {command}: pods not read: {'; '.join(missing)}", file=sys.stderr)
        return EXIT_BROKEN
    return Fetched(base, proofs)
