"""`cachewitness evidence attest`: one case's in-toto attestation, a DSSE envelope (docs/cli.md).

The records come from a sidecar (`?proof=inclusion`, with `--url`, `--token-file`) or a run
bundle (`--from-bundle`); the key is `--key-file`, else the sidecar's own
(`CACHEWITNESS_EVIDENCE_SIGNING_KEY_FILE`). Exit 0: written; 2: bad input (no key, no such case,
a subject file that cannot be read); 8/9 as the other client commands.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from proxy.cli.http import EXIT_BAD_INPUT, common_arguments
from proxy.cli.proof_fetch import Fetched, fetch_proofs
from proxy.evidence.attest import CaseRecords, case_records, envelope, statement
from proxy.evidence.bundle import BundleError, proven_records, read_bundle, safe_name
from proxy.evidence.keys import KeyFileError, SigningKey, load_signing_key
from proxy.evidence.tar_read import printable
from proxy.vocabulary import EventType

__all__ = ["KEY_ENV", "add_attest_command", "attestations", "session_cases", "signing_key"]

KEY_ENV = "CACHEWITNESS_EVIDENCE_SIGNING_KEY_FILE"
_NO_CASE = "no-case"


def add_attest_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`evidence attest` and its options."""
    attest = commands.add_parser(
        "attest",
        help="one case's in-toto attestation (a Statement v1 in a DSSE envelope), signed with the evidence key",
        description="Exit 0: written; 2: bad input; 8/9 as the other client commands.",
    )
    common_arguments(attest)
    attest.add_argument("--session-id", required=True, metavar="S")
    attest.add_argument(
        "--case-id", default=None, metavar="C", help="needed when the session has several cases"
    )
    attest.add_argument(
        "--subject",
        action="append",
        default=[],
        metavar="FILE",
        help="a result file of the benchmark's to attest too (its SHA-256), e.g. aiperf's export; repeatable",
    )
    attest.add_argument("-o", "--out", required=True, metavar="FILE", help="the envelope to write (JSON)")
    attest.add_argument(
        "--key-file", default=None, metavar="KEY", help=f"the evidence signing key (else env {KEY_ENV})"
    )
    attest.add_argument("--from-bundle", default=None, metavar="B", help="read the records from a run bundle")
    attest.set_defaults(run=run_attest)


def signing_key(path: str | None, env: Mapping[str, str]) -> SigningKey | None:
    """The key `--key-file` names, else the sidecar's (the environment's); None when neither."""
    path = path or env.get(KEY_ENV)
    return load_signing_key(path) if path else None


def _checkpoints(lines: Sequence[bytes]) -> tuple[dict[tuple[str, bytes], Any], dict[Any, dict[str, Any]]]:
    """In one pod's proof: each record's checkpoint (by file and line), and each checkpoint as the
    predicate names it (by file and seq)."""
    of_record: dict[tuple[str, bytes], Any] = {}
    held: dict[Any, dict[str, Any]] = {}
    for line in lines:
        entry = orjson.loads(line)
        if entry.get("event_type") == EventType.PROOF_INCLUSION:
            of_record[(entry["file"], entry["line"].encode())] = (entry["file"], entry.get("checkpoint_seq"))
        elif entry.get("event_type") == EventType.PROOF_CHECKPOINT:
            checkpoint = orjson.loads(entry["line"])
            held[(entry["file"], entry["seq"])] = {
                "file": entry["file"],
                "writer_id": entry.get("writer_id"),
                "seq": entry["seq"],
                "tree_size": checkpoint.get("tree_size"),
                "root": checkpoint.get("root"),
                "note": checkpoint.get("note"),
            }
    return of_record, held


def session_cases(proofs: Mapping[str, Sequence[bytes]], session_id: str) -> list[str | None]:
    """The session's case ids (None: records of no case), in the order first seen."""
    seen: dict[str | None, None] = {}
    for lines in proofs.values():
        for file_lines in proven_records(lines).values():
            for line in file_lines:
                record = orjson.loads(line)
                if record.get("session_id") == session_id:
                    seen[record.get("case_id")] = None
    return list(seen)


def attestations(
    proofs: Mapping[str, Sequence[bytes]],
    session_id: str,
    case_ids: Sequence[str | None],
    key: SigningKey,
    extra: Sequence[tuple[str, bytes]] = (),
) -> dict[str, bytes]:
    """One envelope per case, by its file name (`<case>.dsse.json`)."""
    out: dict[str, bytes] = {}
    for case_id in case_ids:
        pods: list[tuple[CaseRecords, list[dict[str, Any]]]] = []
        for pod, lines in sorted(proofs.items()):
            case = case_records(pod, proven_records(lines), session_id, case_id)
            if not case.lines:
                continue
            of_record, held = _checkpoints(lines)
            used = {of_record[key_] for key_ in case.lines if key_ in of_record}
            pods.append((case, [held[c] for c in sorted(used, key=lambda c: (c[0], c[1] or 0)) if c in held]))
        body = statement(session_id, case_id, pods, extra)
        name = f"{safe_name(case_id) if case_id is not None else _NO_CASE}.dsse.json"
        out[name] = orjson.dumps(envelope(body, key), option=orjson.OPT_INDENT_2) + b"\n"
    return out


def _proofs(ns: argparse.Namespace, env: Mapping[str, str]) -> dict[str, list[bytes]] | int:
    if ns.from_bundle:
        try:
            return read_bundle(Path(ns.from_bundle)).proofs
        except BundleError as exc:
            print(f"cachewitness evidence attest: {printable(str(exc))}", file=sys.stderr)
            return EXIT_BAD_INPUT
    fetched = fetch_proofs("attest", ns, env)
    return fetched.proofs if isinstance(fetched, Fetched) else fetched


def run_attest(ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    """Write the case's attestation."""
    env = os.environ if env is None else env
    try:
        key = signing_key(ns.key_file, env)
        extra = [(Path(name).name, Path(name).read_bytes()) for name in ns.subject]
    except (KeyFileError, OSError) as exc:
        print(f"cachewitness evidence attest: {printable(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if key is None:
        print(
            f"cachewitness evidence attest: no signing key: give --key-file (or set {KEY_ENV})",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    proofs = _proofs(ns, env)
    if isinstance(proofs, int):
        return proofs
    cases = session_cases(proofs, ns.session_id)
    wanted = ns.case_id if ns.case_id is not None else (cases[0] if len(cases) == 1 else "")
    if wanted not in cases:
        named = ", ".join(str(case) for case in cases) or "none"
        print(
            f"cachewitness evidence attest: session {ns.session_id!r} has no case {ns.case_id!r} to attest "
            f"(its cases: {named}); give --case-id",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    [data] = attestations(proofs, ns.session_id, [wanted], key, extra).values()
    try:
        Path(ns.out).write_bytes(data)
    except OSError as exc:
        print(f"cachewitness evidence attest: cannot write {ns.out}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {ns.out}: case {wanted!r} of session {ns.session_id!r}, signed by {key.public.fingerprint}")
    return 0
