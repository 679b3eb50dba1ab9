"""Checking a bundle's attestations: each DSSE envelope's signature, and its subjects against the
records the bundle proves (docs/evidence.md).

An envelope must be signed, over DSSE's PAE bytes, by the pinned key or else one of the keys the
bundle's checkpoints carry; it must hold an in-toto Statement v1 of the cold-case predicate; every
subject named as an evidence line (`<pod>/<file>#<seq>`) must be one of the bundle's proven
records, byte for byte (its SHA-256), and every record of its case in the bundle must be a
subject: a record removed from the bundle, or added to it, shows.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable, Mapping, Sequence

import orjson

from proxy.evidence.attest import PAYLOAD_TYPE, PREDICATE_TYPE, STATEMENT_TYPE, case_records, pae
from proxy.evidence.keys import PublicKey

__all__ = ["check_attestation"]


def _signed_payload(envelope: object, keys: Sequence[PublicKey]) -> bytes | str:
    """The payload, when a key signed it; else what is wrong."""
    if not isinstance(envelope, dict) or envelope.get("payloadType") != PAYLOAD_TYPE:
        return f"not a DSSE envelope of {PAYLOAD_TYPE}"
    try:
        payload = base64.b64decode(str(envelope.get("payload")), validate=True)
        signatures = [
            (s.get("keyid"), base64.b64decode(str(s.get("sig")), validate=True))
            for s in envelope.get("signatures") or []
            if isinstance(s, dict)
        ]
    except (binascii.Error, ValueError):
        return "its payload or a signature is not base64"
    message = pae(PAYLOAD_TYPE, payload)
    for keyid, signature in signatures:
        for key in keys:
            if keyid == key.fingerprint and key.verifies_raw(signature, message):
                return payload
    return "no signature by " + (", ".join(k.fingerprint for k in keys) or "a key the bundle holds")


def check_attestation(
    name: str,
    data: bytes,
    keys: Sequence[PublicKey],
    pods: Mapping[str, Mapping[str, list[bytes]]],
    session_id: str,
) -> list[str]:
    """What is wrong with one attestation of the bundle (empty: nothing)."""
    try:
        payload = _signed_payload(orjson.loads(data), keys)
    except orjson.JSONDecodeError:
        payload = "not JSON"
    if isinstance(payload, str):
        return [f"{name}: {payload}"]
    try:
        statement = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return [f"{name}: its payload is not JSON"]
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        return [f"{name}: not an in-toto Statement v1"]
    predicate = statement.get("predicate")
    if statement.get("predicateType") != PREDICATE_TYPE or not isinstance(predicate, dict):
        return [f"{name}: not a {PREDICATE_TYPE} statement"]
    if predicate.get("session_id") != session_id:
        return [f"{name}: it attests session {predicate.get('session_id')!r}, not the bundle's"]
    digests = {
        f"{pod}/{file}": {hashlib.sha256(line).hexdigest() for line in lines}
        for pod, files in pods.items()
        for file, lines in files.items()
    }
    problems = []
    named = set()
    for subject in statement.get("subject") or []:
        where, sep, _seq = str(subject.get("name")).rpartition("#")
        digest = (subject.get("digest") or {}).get("sha256")
        if not sep or where not in digests:
            continue  # a result file of the benchmark's: checked by whoever holds it
        named.add(digest)
        if digest not in digests[where]:
            problems.append(
                f"{name}: subject {subject.get('name')} is not among the bundle's records (removed or edited?)"
            )
    case_id = predicate.get("case_id")
    for pod, files in pods.items():
        for file, line in case_records(pod, files, session_id, case_id).lines:
            if hashlib.sha256(line).hexdigest() not in named:
                problems.append(
                    f"{name}: the bundle's record {pod}/{file} {_seq_of(line)} is not one it attests (added?)"
                )
    return problems


def _seq_of(line: bytes) -> str:
    try:
        return f"seq {orjson.loads(line).get('seq')}"
    except (orjson.JSONDecodeError, AttributeError):
        return "(not JSON)"


def bundle_keys(pinned: PublicKey | None, carried: Iterable[PublicKey]) -> list[PublicKey]:
    """The keys an attestation may be signed by: the pinned one, else those the checkpoints carry."""
    return [pinned] if pinned is not None else list(carried)
