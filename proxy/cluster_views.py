"""`GET /cache/state?scope=cluster` and `GET /cache/evidence?scope=cluster`: every peer's view, merged.

A pod that cannot be read is named (in `unreadable`, or in the evidence's trailing
`cachewitness.cluster_read` line), never dropped silently.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.cluster import PEER_CLIENT, admin_headers
from proxy.cluster_report import CLUSTER_READ_EVENT
from proxy.config import SETTINGS
from proxy.errors import error_response
from proxy.peers import Peer, PeerSet, discover_peers

__all__ = ["CLUSTER_READ_EVENT", "cluster_evidence", "cluster_state"]

READ_TIMEOUT_S = 60.0
_STATE_READ_LIMIT = 1024 * 1024
# Merged evidence is sorted in memory: a pod holding more than this for the filters is named, not read.
MAX_POD_EVIDENCE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class PodRead:
    """One pod's answer to a read, or why there is none."""

    pod: str
    url: str
    status: int | None
    body: bytes = b""
    error: str | None = None

    def unreadable(self) -> dict[str, Any]:
        """The entry naming a pod that could not be read."""
        return {"pod": self.pod, "url": self.url, "status": self.status, "error": self.error}


def _error_message(raw: bytes) -> str:
    """An OpenAI-style error's message, else the start of the body."""
    try:
        return str(orjson.loads(raw)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return raw[:200].decode("utf-8", errors="replace") or "(no body)"


async def _read_pod(
    session: aiohttp.ClientSession,
    peer: Peer,
    path: str,
    headers: dict[str, str],
    deadline: float,
    limit: int,
) -> PodRead:
    """GET `path` from one pod, bounded in time and size; never raises (except cancellation)."""
    url = f"{peer.base_url}{path}"
    try:
        async with asyncio.timeout_at(deadline):
            async with session.get(url, headers=headers, allow_redirects=False) as response:
                body = await response.content.read(limit + 1)
                status = response.status
    except TimeoutError:
        return PodRead(peer.address, url, None, error=f"no answer within {READ_TIMEOUT_S:g} s")
    except (aiohttp.ClientError, OSError) as exc:
        return PodRead(peer.address, url, None, error=f"cannot reach the pod: {type(exc).__name__}: {exc}")
    if status != 200:
        return PodRead(peer.address, url, status, error=f"HTTP {status}: {_error_message(body)}")
    if len(body) > limit:
        return PodRead(
            peer.address, url, status, error=f"more than {limit} bytes match: read this pod on its own"
        )
    return PodRead(peer.address, url, status, body)


async def _read_all(request: web.Request, path: str, limit: int) -> tuple[PeerSet, list[PodRead]]:
    """The peers of this call and each one's answer to GET `path`, read concurrently."""
    settings = request.app[SETTINGS]
    peers = await discover_peers(settings)
    deadline = asyncio.get_running_loop().time() + READ_TIMEOUT_S
    headers = admin_headers(settings)
    session = request.app[PEER_CLIENT]
    reads = await asyncio.gather(
        *(_read_pod(session, peer, path, headers, deadline, limit) for peer in peers.peers)
    )
    return peers, list(reads)


def _no_peers(peers: PeerSet) -> web.Response:
    """502: an empty peer set is never an empty success."""
    message = f"no peers to read ({peers.source}): {peers.error}; {peers.hint}"
    return error_response(502, message, type_="cluster_error", code="no_peers")


async def cluster_state(request: web.Request) -> web.Response:
    """Every pod's `/cache/state`, each under its pod, and the pods that could not be read."""
    peers, reads = await _read_all(request, "/cache/state", _STATE_READ_LIMIT)
    if not peers.peers:
        return _no_peers(peers)
    pods: list[dict[str, Any]] = []
    unreadable: list[dict[str, Any]] = []
    for read in reads:
        if read.error is None:
            try:
                pods.append({"pod": read.pod, "url": read.url, "state": orjson.loads(read.body)})
                continue
            except orjson.JSONDecodeError:
                read = PodRead(read.pod, read.url, read.status, error="the answer is not JSON")
        unreadable.append(read.unreadable())
    verdicts: dict[str, int] = {}
    for pod in pods:
        verdict = str(pod["state"].get("verdict")) if isinstance(pod["state"], dict) else "None"
        verdicts[verdict] = verdicts.get(verdict, 0) + 1
    return web.json_response(
        {
            "scope": "cluster",
            "peers_source": peers.source,
            "pods": pods,
            "unreadable": unreadable,
            "verdicts": verdicts,
        }
    )


def _tagged_records(read: PodRead) -> tuple[list[dict[str, Any]], int]:
    """A pod's evidence lines as records tagged with `pod`, and how many lines were not records."""
    records: list[dict[str, Any]] = []
    unparsed = 0
    for line in read.body.splitlines():
        if not line.strip():
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            unparsed += 1
            continue
        if not isinstance(record, dict):
            unparsed += 1
            continue
        record["pod"] = read.pod
        records.append(record)
    return records, unparsed


def _at_ns(record: dict[str, Any]) -> int:
    """The sort key of merged evidence (a record without a numeric `at_ns` goes first)."""
    value = record.get("at_ns")
    return value if isinstance(value, int) else 0


async def cluster_evidence(request: web.Request, filters: Mapping[str, str]) -> web.StreamResponse:
    """Every pod's matching lines, ordered by `at_ns`, each tagged with `pod`, then a `cluster_read` line."""
    query = urllib.parse.urlencode(dict(filters))
    peers, reads = await _read_all(
        request, "/cache/evidence" + (f"?{query}" if query else ""), MAX_POD_EVIDENCE_BYTES
    )
    if not peers.peers:
        return _no_peers(peers)
    merged: list[dict[str, Any]] = []
    read_ok: list[str] = []
    unreadable: list[dict[str, Any]] = []
    unparsed = 0
    for read in reads:
        if read.error is not None:
            unreadable.append(read.unreadable())
            continue
        records, bad = _tagged_records(read)
        merged.extend(records)
        unparsed += bad
        read_ok.append(read.pod)
    merged.sort(key=_at_ns)  # stable: one pod's lines keep their order at equal times
    summary = {
        "schema_version": 1,
        "event_type": CLUSTER_READ_EVENT,
        "at_ns": time.time_ns(),
        "scope": "cluster",
        "peers_source": peers.source,
        "pods_read": read_ok,
        "unreadable": unreadable,
        "records": len(merged),
        "unparsed_lines": unparsed,
    }
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    batch: list[bytes] = []
    for record in [*merged, summary]:
        batch.append(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
        if len(batch) >= 512:
            await response.write(b"".join(batch))
            batch = []
    if batch:
        await response.write(b"".join(batch))
    await response.write_eof()
    return response
