"""`cachewitness evidence bundle`: one session's records with their Merkle proofs, offline-checkable
(docs/cli.md). Exit 0: written and whole; 1: written, but a proof does not hold (or a pod could not
be read); 2: bad input; 8/9 as the other client commands."""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
import time
from collections.abc import Mapping
from pathlib import Path

from proxy.cli.attest import KEY_ENV, attestations, session_cases, signing_key
from proxy.cli.http import EXIT_BAD_INPUT, common_arguments
from proxy.cli.proof_fetch import EXIT_BROKEN, Fetched, fetch_proofs, print_report
from proxy.evidence.bundle import (
    BundleError,
    cases_of,
    checkpoint_keys,
    proven_records,
    read_bundle,
    verify_bundle,
    write_bundle,
)
from proxy.evidence.keys import KeyFileError
from proxy.evidence.tar_read import printable
from proxy.redact import redact_url

__all__ = ["add_bundle_command", "run_bundle"]


def add_bundle_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`evidence bundle` and its options."""
    bundle = commands.add_parser(
        "bundle",
        help="one session's records with the Merkle proofs that prove them, offline-checkable",
        description="Exit 0: bundle written and whole; 1: written, but a proof does not hold; "
        "2/8/9 as the other client commands.",
    )
    common_arguments(bundle)
    bundle.add_argument("--session-id", required=True, metavar="S")
    bundle.add_argument("-o", "--out", required=True, metavar="FILE", help="the bundle to write (.tar.gz)")
    bundle.add_argument(
        "--key-file",
        default=None,
        metavar="KEY",
        help=f"the evidence signing key: one attestation per case goes in the bundle (else env {KEY_ENV}; "
        "without either, none)",
    )
    bundle.set_defaults(run=run_bundle)


def run_bundle(ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    """Fetch the session's proofs, write the bundle with an attestation per case, check it."""
    env = os.environ if env is None else env
    try:
        key = signing_key(ns.key_file, env)
    except KeyFileError as exc:
        print(f"cachewitness evidence bundle: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    fetched = fetch_proofs("bundle", ns, env)
    if not isinstance(fetched, Fetched):
        return fetched
    proofs = fetched.proofs
    pods = {pod: proven_records(lines) for pod, lines in proofs.items()}
    cases = cases_of(pods, ns.session_id)
    if not cases:
        print(
            f"cachewitness evidence bundle: no records of session {ns.session_id!r} at {redact_url(fetched.base)}",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    keys = checkpoint_keys(proofs)
    summary = {
        "schema_version": 2,
        "session_id": ns.session_id,
        "created_at_ns": time.time_ns(),
        "source": redact_url(fetched.base),
        "scope": ns.scope,
        "pods": [{"pod": pod, "chains": sorted(chains)} for pod, chains in sorted(pods.items())],
        "keys": [key.fingerprint for key in keys],
        "cases": cases,
    }
    signed = attestations(proofs, ns.session_id, session_cases(proofs, ns.session_id), key) if key else {}
    out = Path(ns.out)
    try:
        size = write_bundle(out, summary, keys, proofs, signed)
        reports, problems = verify_bundle(read_bundle(out), None)
    except (OSError, tarfile.TarError, BundleError) as exc:
        print(f"cachewitness evidence bundle: cannot write {out}: {printable(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for report in reports:
        print_report(report)
    for problem in problems:
        print(f"broken: {printable(problem)}")
    records = sum(len(lines) for chains in pods.values() for lines in chains.values())
    print(
        f"wrote {out}: {size} bytes, {len(cases)} cases, {records} records proven from {len(pods)} pods, "
        f"{len(signed)} attestations"
    )
    return EXIT_BROKEN if problems or not all(report.whole for report in reports) else 0
