"""A run bundle: one session's records with the Merkle proofs that prove them (docs/evidence.md).

`run.tar.gz` holds `summary.json` (the session, its cases and their verdicts, per pod), each
pod's `?proof=inclusion` answer for the session as `proofs/<pod>.jsonl` (its records exactly as
written, their audit paths, the signed checkpoints, the consistency proofs between them: no
other session's records), the public keys that signed them as `keys/<fingerprint>.pem`, and one
in-toto attestation per case as `attestations/<case>.dsse.json`. `cachewitness evidence verify
run.tar.gz` checks every proof offline and that the summary is what the records say. A bundle of
an older version (`pods/<pod>/<file>`: whole chain segments) is checked as chains.
"""

from __future__ import annotations

import dataclasses
import io
import re
import tarfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from proxy.evidence.attest_check import bundle_keys, check_attestation
from proxy.evidence.keys import PublicKey
from proxy.evidence.proof_check import MalformedProof, ProofCheck, ProofReport
from proxy.evidence.summary import summarize
from proxy.evidence.tar_read import DEFAULT_LIMITS, Limits, UnsafeBundle, printable, read_members
from proxy.evidence.verify import ChainCheck, ChainReport

__all__ = [
    "Bundle",
    "BundleError",
    "cases_of",
    "read_bundle",
    "verify_bundle",
    "write_bundle",
]

_SAFE = re.compile(r"[^A-Za-z0-9._-]")
# How a proof answer's entries start (orjson writes no spaces).
_INCLUSION = b'{"event_type":"cachewitness.inclusion"'
_CHECKPOINT = b'{"event_type":"cachewitness.checkpoint"'


class BundleError(Exception):
    """A file that is not a readable bundle."""


def _at_ns(record: dict[str, Any]) -> int:
    value = record.get("at_ns")
    return value if isinstance(value, int) else 0


def safe_name(text: str) -> str:
    """A pod's or file's name as a path part of the bundle."""
    return _SAFE.sub("_", text) or "_"


def listed_pods(summary: Mapping[str, Any]) -> list[str]:
    """The pod names a summary lists (entries that are not `{"pod": …}` objects are skipped)."""
    pods = summary.get("pods")
    if not isinstance(pods, list):
        return []
    return [str(pod.get("pod")) for pod in pods if isinstance(pod, dict)]


def cases_of(pods: Mapping[str, Mapping[str, list[bytes]]], session_id: str) -> list[dict[str, Any]]:
    """The session's cases on each pod, from its records: reset answer, verified, verdict, tokens."""
    cases: list[dict[str, Any]] = []
    for pod, chains in sorted(pods.items()):
        records = []
        for lines in chains.values():
            for line in lines:
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(record, dict) and record.get("session_id") == session_id:
                    records.append(record)
        records.sort(key=_at_ns)
        for case in summarize(records):
            cases.append({"pod": pod, **dataclasses.asdict(case), "hit_ratio": case.hit_ratio})
    return cases


def write_bundle(
    path: Path,
    summary: dict[str, Any],
    keys: Iterable[PublicKey],
    proofs: Mapping[str, list[bytes]],
    attestations: Mapping[str, bytes] | None = None,
) -> int:
    """Write the bundle (gzip'd tar): summary, keys, each pod's proof, the attestations; its size."""
    now = int(time.time())

    def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), now, 0o644
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(path, "w:gz") as tar:
        add(tar, "summary.json", orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
        for key in keys:
            add(tar, f"keys/{key.fingerprint.removeprefix('sha256:')[:16]}.pem", key.pem())
        for pod, lines in sorted(proofs.items()):
            add(tar, f"proofs/{safe_name(pod)}.jsonl", b"".join(lines))
        for name, data in sorted((attestations or {}).items()):
            add(tar, f"attestations/{safe_name(name)}", data)
    return path.stat().st_size


def proven_records(lines: Iterable[bytes]) -> dict[str, list[bytes]]:
    """The records a Merkle proof answer carries, by file, each line exactly as written."""
    records: dict[str, list[bytes]] = {}
    for line in lines:
        if not line.startswith(_INCLUSION):
            continue
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("line"), str):
            records.setdefault(str(entry.get("file")), []).append(entry["line"].encode())
    return records


def checkpoint_keys(proofs: Mapping[str, list[bytes]]) -> list[PublicKey]:
    """The public keys the proofs' checkpoints carry (not yet checked: ProofCheck does that)."""
    keys: dict[str, PublicKey] = {}
    for lines in proofs.values():
        for line in lines:
            if not line.startswith(_CHECKPOINT):
                continue
            try:
                checkpoint = orjson.loads(orjson.loads(line)["line"])
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
            key = PublicKey.from_text(checkpoint.get("public_key") if isinstance(checkpoint, dict) else None)
            if key is not None:
                keys[key.fingerprint] = key
    return list(keys.values())


@dataclass(frozen=True)
class Bundle:
    """A bundle read back: its summary and, by the summary's pod names, each pod's records by file
    (an older bundle's: its chain segments), its Merkle proof answer, and the attestations."""

    summary: dict[str, Any]
    pods: dict[str, dict[str, list[bytes]]]
    proofs: dict[str, list[bytes]] = field(default_factory=dict)
    attestations: dict[str, bytes] = field(default_factory=dict)


def read_bundle(path: Path, limits: Limits = DEFAULT_LIMITS) -> Bundle:
    """Read a bundle (bounded: proxy/evidence/tar_read.py); BundleError, one line, when it is not one."""
    try:
        members = read_members(path, limits)
    except UnsafeBundle as exc:
        raise BundleError(f"{printable(str(path))}: {exc}") from None
    if "summary.json" not in members:
        raise BundleError(f"{path} has no summary.json: not a cachewitness bundle")
    try:
        summary = orjson.loads(members["summary.json"])
    except orjson.JSONDecodeError as exc:
        raise BundleError(f"{path}: summary.json is not JSON: {exc}") from None
    if not isinstance(summary, dict):
        raise BundleError(f"{path}: summary.json is not a JSON object")
    by_dir = {safe_name(pod): pod for pod in listed_pods(summary)}
    bundle = Bundle(summary, {})
    for name in list(members):
        data = members.pop(name)  # one copy at a time: the bytes, or their lines
        parts = name.split("/")
        lines = data.splitlines(keepends=True)
        if len(parts) == 3 and parts[0] == "pods":  # an older bundle's chain segments
            bundle.pods.setdefault(by_dir.get(parts[1], parts[1]), {})[parts[2]] = lines
        elif len(parts) == 2 and parts[0] == "proofs" and parts[1].endswith(".jsonl"):
            pod = by_dir.get(parts[1].removesuffix(".jsonl"), parts[1].removesuffix(".jsonl"))
            bundle.proofs[pod] = lines
            bundle.pods[pod] = proven_records(lines)
        elif len(parts) == 2 and parts[0] == "attestations":
            bundle.attestations[parts[1]] = data
    return bundle


def verify_bundle(
    bundle: Bundle, pinned: PublicKey | None
) -> tuple[list[ChainReport | ProofReport], list[str]]:
    """Each pod's proof check (each segment's, in an older bundle), and what is wrong beyond them;
    BundleError for a proof that is malformed (bad input, not a broken proof)."""
    reports: list[ChainReport | ProofReport] = []
    problems: list[str] = []
    for pod, lines in sorted(bundle.proofs.items()):
        name = f"proofs/{safe_name(pod)}.jsonl"
        proof = ProofCheck(name, pinned=pinned)
        try:
            for number, line in enumerate(lines, 1):
                proof.feed(line, number)
        except MalformedProof as exc:
            raise BundleError(f"{exc} (a malformed proof: not a bundle verify can check)") from None
        reports.append(proof.finish())
    for pod, chains in sorted(bundle.pods.items()):
        if pod in bundle.proofs:
            continue
        for file, lines in sorted(chains.items()):
            name = f"pods/{safe_name(pod)}/{file}"
            check = ChainCheck(name, pinned=pinned)
            for number, line in enumerate(lines, 1):
                check.feed(line, name, number)
            reports.append(check.finish())
    listed = set(listed_pods(bundle.summary))
    if listed != set(bundle.pods):
        problems.append(
            f"summary.json lists pods {sorted(listed)} but the bundle holds records of {sorted(bundle.pods)}"
        )
    session = bundle.summary.get("session_id")
    if not isinstance(session, str):
        problems.append("summary.json names no session_id")
        return reports, problems
    if bundle.summary.get("cases") != cases_of(bundle.pods, session):
        problems.append("summary.json: its cases are not what the bundle's records say")
    signers = {fingerprint for report in reports for fingerprint in report.keys}
    carried = [key for key in checkpoint_keys(bundle.proofs) if key.fingerprint in signers]
    for name, data in sorted(bundle.attestations.items()):
        problems += check_attestation(
            f"attestations/{name}", data, bundle_keys(pinned, carried), bundle.pods, session
        )
    return reports, problems
