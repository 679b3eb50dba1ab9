"""The admin views: `POST /cache/reset`, `GET /cache/state` and `GET /cache/evidence`.

Each takes `scope=cluster` as well, and hands it to proxy/cluster/ (docs/cluster.md); admin
stands above both reset and cluster, so the dispatch lives here.
"""

from __future__ import annotations

import re
from contextlib import aclosing

import orjson
from aiohttp import web

from proxy.admin.proofs import consistency_proof, inclusion_proof
from proxy.admission import ADMISSION
from proxy.cluster.evidence import cluster_evidence, cluster_proof
from proxy.cluster.fanout import cluster_reset
from proxy.cluster.state import cluster_state
from proxy.config import SETTINGS
from proxy.engine_state import ENGINE
from proxy.errors import error_response
from proxy.evidence.log import EVIDENCE
from proxy.forward.ids import is_stored_id
from proxy.health import HEALTH
from proxy.recorder import RECORDER
from proxy.reset.params import BadInput, read_params
from proxy.reset.service import RESETS
from proxy.vocabulary import EventType, Scope
from proxy.witnesses.traffic import WITNESS

__all__ = ["handle_evidence", "handle_reset", "handle_state"]

# The records a pod stores (the cachewitness.* lines are a read's own: the cluster trailer, a proof's markers).
_EVENT_TYPES = frozenset(str(kind) for kind in EventType if not kind.startswith("cachewitness."))
_FILTERS = ("session_id", "case_id", "event_type", "since_ns", "scope", "proof", "from", "to", "file")
_PROOFS = ("0", "1", "inclusion", "consistency")
# Matching lines go out in writes of about this size, not one write per line.
_WRITE_BYTES = 64 * 1024
_ASCII_DIGITS = re.compile(r"[0-9]{1,20}")


async def handle_reset(request: web.Request) -> web.Response:
    """`POST /cache/reset`: a 400 naming the field for bad input, else the answer of docs/reset.md."""
    try:
        params = await read_params(request, request.app[SETTINGS])
    except BadInput as bad:
        return error_response(400, bad.message, type_="invalid_request_error", code=bad.code, param=bad.param)
    if params.scope == Scope.CLUSTER:
        return await cluster_reset(request, params)
    status, body = await request.app[RESETS].reset(params)
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _scope(request: web.Request) -> Scope | web.Response:
    """`?scope=pod` (default) or `?scope=cluster`; a 400 for anything else."""
    scope = request.query.get("scope", Scope.POD)
    if scope not in tuple(Scope):
        return _bad_filter("scope", 'scope must be "pod" or "cluster"')
    return Scope(scope)


async def handle_state(request: web.Request) -> web.Response:
    """The last reset, its verdict, counters since it, and the engine behind us (every pod's with scope=cluster)."""
    scope = _scope(request)
    if isinstance(scope, web.Response):
        return scope
    if scope == Scope.CLUSTER:
        return await cluster_state(request)
    app = request.app
    state = app[WITNESS].state()
    state["engine"] = app[ENGINE].info.to_json()
    events = app[RECORDER].kv_events
    if events is not None:  # each rank's KV event endpoints and where they come from
        state["kv_events"] = events.describe()
    admission = app[ADMISSION]
    evidence = app[EVIDENCE]
    state["sidecar"] = {
        "inflight_requests": admission.inflight,
        "held_requests": admission.held,
        "draining": admission.draining,
        "upstream_up": app[HEALTH].upstream_up,
        "evidence_path": app[SETTINGS].evidence,
        "evidence_resets_path": app[SETTINGS].resets_evidence,
        "evidence_write_errors_total": evidence.write_errors_total,
        "evidence_dropped_total": evidence.dropped_total,
        # The key that signs the evidence checkpoints (None: unsigned), see docs/evidence.md.
        "evidence_key_fingerprint": evidence.observations.key_fingerprint,
    }
    return web.json_response(state)


def _bad_filter(param: str, message: str) -> web.Response:
    """400 naming the filter at fault."""
    return error_response(400, message, type_="invalid_request_error", code="invalid_filter", param=param)


async def handle_evidence(request: web.Request) -> web.StreamResponse:
    """Stream the evidence lines that match the query's filters, as JSON lines."""
    query = request.query
    unknown = sorted(set(query) - set(_FILTERS))
    if unknown:
        return _bad_filter(unknown[0], f"unknown filter {unknown[0]!r}; filters are {', '.join(_FILTERS)}")
    for name in _FILTERS:
        if len(query.getall(name, ())) > 1:
            return _bad_filter(name, f"{name} is given more than once; give each filter at most once")
    for name in ("session_id", "case_id"):
        # An id the evidence stored escaped (`%XX`, see proxy/forward/ids.py) is found as stored.
        if name in query and not is_stored_id(query[name]):
            return _bad_filter(
                name, f"{name} must be 1-128 characters of [A-Za-z0-9._:-] (or %XX escapes, as stored)"
            )
    event_type = query.get("event_type")
    if event_type is not None and event_type not in _EVENT_TYPES:
        return _bad_filter("event_type", f"event_type must be one of {', '.join(sorted(_EVENT_TYPES))}")
    since_ns: int | None = None
    if "since_ns" in query:
        text = query["since_ns"]
        # int() would also take " 12 ", "1_000", "-5" and non-ASCII digits such as "٣".
        if not _ASCII_DIGITS.fullmatch(text):
            return _bad_filter(
                "since_ns", "since_ns must be ASCII digits 0-9 only (nanoseconds since the epoch)"
            )
        since_ns = int(text)
    scope = _scope(request)
    if isinstance(scope, web.Response):
        return scope
    proof = query.get("proof", "0")
    if proof not in _PROOFS:
        return _bad_filter(
            "proof",
            "proof must be inclusion (audit paths), consistency (between two checkpoints), "
            "1 (the chain segments that prove the records) or 0",
        )
    for name in ("from", "to", "file"):
        if name in query and proof != "consistency":
            return _bad_filter(name, f"{name} is a parameter of proof=consistency only")
    if proof == "inclusion" and "session_id" not in query and "case_id" not in query:
        # Every record's proof is the whole log, held while it is built: that is what the files are for.
        return _bad_filter("session_id", "proof=inclusion needs session_id or case_id (one session's proofs)")
    filters = {k: v for k, v in query.items() if k not in ("scope", "proof")}
    if scope == Scope.CLUSTER:
        if proof == "consistency":
            return _bad_filter("scope", "proof=consistency is one pod's: ask that pod")
        if proof in ("1", "inclusion"):
            return await cluster_proof(request, filters, proof)
        return await cluster_evidence(request, filters)
    app = request.app
    evidence = app[EVIDENCE]
    if proof == "consistency":
        return await consistency_proof(request)
    if proof == "inclusion":
        return await inclusion_proof(
            request,
            {
                "session_id": query.get("session_id"),
                "case_id": query.get("case_id"),
                "event_type": event_type,
                "since_ns": since_ns,
            },
        )
    if proof == "1":
        return await _stream_proof(request, event_type=event_type, since_ns=since_ns)
    # Records of requests that just finished may still sit in the batch: write them first.
    # Both files are read, merged by at_ns (proxy/evidence/log.py).
    await evidence.flush()
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    batch: list[bytes] = []
    size = 0
    async for block in evidence.read(
        session_id=query.get("session_id"),
        case_id=query.get("case_id"),
        event_type=event_type,
        since_ns=since_ns,
    ):
        batch += block
        size += sum(map(len, block))
        if size >= _WRITE_BYTES:
            await response.write(b"".join(batch))
            batch, size = [], 0
    if batch:
        await response.write(b"".join(batch))
    await response.write_eof()
    return response


async def _stream_proof(
    request: web.Request, *, event_type: str | None, since_ns: int | None
) -> web.StreamResponse:
    """`?proof=1`: the chain segments that prove the matching records (docs/evidence.md)."""
    query = request.query
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    proof = request.app[EVIDENCE].proof(
        session_id=query.get("session_id"),
        case_id=query.get("case_id"),
        event_type=event_type,
        since_ns=since_ns,
    )
    async with aclosing(proof) as stream:
        async for data in stream:
            await response.write(data)
    await response.write_eof()
    return response
