"""One in-toto attestation per case: a Statement v1 in a DSSE envelope (docs/evidence.md).

The statement's subjects are the SHA-256 of each of the case's evidence lines, exactly as written
(the hash the chain's next `prev` holds), named `<pod>/<file>#<seq>`, and of any result file the
benchmark adds (`--subject`). Its predicate, `PREDICATE_TYPE`, says what the sidecar claims about
the case (the reset's answer, each witness's result, the traffic verdict, tiers, ranks, bypass,
restarts, the checkpoints that hold the records) and, as plainly, what it does not (`NON_CLAIMS`).
The envelope is signed over DSSE's PAE bytes with the evidence key: whoever verifies DSSE
(securesystemslib, in-toto, sigstore's tools) checks it with the key's public half.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy import __version__
from proxy.evidence.keys import SigningKey
from proxy.observe.overhead import OverheadQuantiles

__all__ = [
    "NON_CLAIMS",
    "PAYLOAD_TYPE",
    "PREDICATE_TYPE",
    "STATEMENT_TYPE",
    "CaseRecords",
    "case_records",
    "envelope",
    "pae",
    "predicate",
    "statement",
]

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
PREDICATE_TYPE = "urn:cachewitness:predicate:cold-case:v1"
NON_CLAIMS = (
    "The engine's own counters and KV cache events are trusted: a witness that reads them proves "
    "no more than the engine reports.",
    "A request never sent through the sidecar leaves no record here, unless the engine's counters "
    "show it (bypass, from the counter witness's reconciliation).",
    "Whoever holds the evidence signing key could write a new log and sign it: these records "
    "prove what the key's holder signed, no more.",
)
# Records of a case, beyond its observations: the reset's and the witnesses' own.
_CASE_EVENTS = frozenset(
    {
        "infer.cache_state",
        "infer.cache_verification",
        "infer.cache_blocks",
        "infer.cache_reconciliation",
        "infer.engine_event",
        "infer.cache_observation",
    }
)


@dataclass(frozen=True)
class CaseRecords:
    """One case's records on one pod: `(file, line)` each, in the order written, parsed beside."""

    pod: str
    session_id: str
    case_id: str | None
    lines: tuple[tuple[str, bytes], ...]
    records: tuple[dict[str, Any], ...]


def case_records(
    pod: str, files: Mapping[str, Sequence[bytes]], session_id: str, case_id: str | None
) -> CaseRecords:
    """The records of (session, case) among one pod's lines by file (case None: those of no case)."""
    chosen: list[tuple[int, str, bytes, dict[str, Any]]] = []
    for file, lines in sorted(files.items()):
        for line in lines:
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if (
                isinstance(record, dict)
                and record.get("event_type") in _CASE_EVENTS
                and record.get("session_id") == session_id
                and record.get("case_id") == case_id
            ):
                at_ns = record.get("at_ns")
                chosen.append((at_ns if isinstance(at_ns, int) else 0, file, line, record))
    chosen.sort(key=lambda item: item[0])
    return CaseRecords(
        pod,
        session_id,
        case_id,
        tuple((file, line) for _, file, line, _ in chosen),
        tuple(record for *_, record in chosen),
    )


def _of(records: Iterable[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event_type") == event]


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _pod_claims(case: CaseRecords, checkpoints: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What one pod's records say about the case."""
    states = _of(case.records, "infer.cache_state")
    state: dict[str, Any] = states[-1] if states else {}
    verification = _dict(state.get("verification"))
    verdicts = _of(case.records, "infer.cache_verification")
    reconciliations = _of(case.records, "infer.cache_reconciliation")
    starts = [r for r in _of(case.records, "infer.cache_blocks") if r.get("trigger") == "case_start"]
    reset = _dict(state.get("reset"))
    restarts = [
        r.get("at_ns") for r in _of(case.records, "infer.engine_event") if r.get("kind") == "restarted"
    ]
    observations = _of(case.records, "infer.cache_observation")
    return {
        "pod": case.pod,
        "reset": {
            "reset_id": state.get("reset_id"),
            "answer": reset.get("answer"),
            "success": reset.get("success"),
            "at_ns": reset.get("at_ns"),
            "engine": state.get("engine"),
        }
        if state
        else None,
        "verified": state.get("verified"),
        "witnesses": {
            name: report.get("result") if isinstance(report, dict) else None
            for name, report in (verification.get("witnesses") or {}).items()
        },
        "traffic_verdict": verdicts[-1].get("verdict") if verdicts else None,
        "isolation": starts[-1].get("verification") if starts else None,
        "tiers": verification.get("tiers"),
        "ranks": [
            {"rank": r.get("rank"), "verified": r.get("verified")} for r in verification.get("ranks") or []
        ],
        "bypass": [r.get("bypass") for r in reconciliations],
        "reconciliation": [r.get("verdict") for r in reconciliations],
        "restarts": restarts + [r.get("at_ns") for r in reconciliations if r.get("restarted")],
        "requests": len(observations),
        "overhead": _overhead(observations),
        "records": len(case.records),
        "checkpoints": list(checkpoints),
    }


def _overhead(observations: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The time the sidecar itself added to the case's requests, p50/p99 each way (as /cache/state
    shows it; docs/evidence.md, "The sidecar's added time")."""
    quantiles = OverheadQuantiles()
    for observation in observations:
        spans = _dict(observation.get("overhead"))
        added_in, added_out = spans.get("added_in_us"), spans.get("added_out_us")
        quantiles.add(added_in if _count(added_in) else None, added_out if _count(added_out) else None)
    return quantiles.to_json()


def _count(value: object) -> bool:
    """A whole, non-negative number of microseconds (a record's field, as written)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def predicate(
    session_id: str, case_id: str | None, pods: Sequence[tuple[CaseRecords, Sequence[Mapping[str, Any]]]]
) -> dict[str, Any]:
    """The cold-case predicate (docs/evidence.md has its schema): per pod, its claims and the
    checkpoints that hold its records; then what is not claimed."""
    return {
        "session_id": session_id,
        "case_id": case_id,
        "pods": [_pod_claims(case, checkpoints) for case, checkpoints in pods],
        "non_claims": list(NON_CLAIMS),
        "generator": {"name": "cachewitness", "version": __version__},
    }


def _seq(line: bytes) -> object:
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return record.get("seq") if isinstance(record, dict) else None


def statement(
    session_id: str,
    case_id: str | None,
    pods: Sequence[tuple[CaseRecords, Sequence[Mapping[str, Any]]]],
    extra: Sequence[tuple[str, bytes]] = (),
) -> dict[str, Any]:
    """The in-toto Statement v1: every pod's case lines and the `extra` files (name, bytes) as subjects."""
    subjects = [
        {"name": f"{case.pod}/{file}#{_seq(line)}", "digest": {"sha256": hashlib.sha256(line).hexdigest()}}
        for case, _ in pods
        for file, line in case.lines
    ]
    subjects += [
        {"name": name, "digest": {"sha256": hashlib.sha256(data).hexdigest()}} for name, data in extra
    ]
    return {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate(session_id, case_id, pods),
    }


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: `DSSEv1 <len> <type> <len> <payload>`."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %b %d %b" % (len(kind), kind, len(payload), payload)


def envelope(body: Mapping[str, Any], key: SigningKey) -> dict[str, Any]:
    """The DSSE envelope of a statement, signed over its PAE bytes; `keyid` is the key's fingerprint."""
    payload = orjson.dumps(body)
    signature = key.sign_raw(pae(PAYLOAD_TYPE, payload))
    return {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode(),
        "signatures": [{"keyid": key.public.fingerprint, "sig": base64.b64encode(signature).decode()}],
    }
