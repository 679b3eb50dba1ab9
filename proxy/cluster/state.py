"""`GET /cache/state?scope=cluster`: every pod's state under its name, and the pods that could not be read.

A pod that cannot be read is named in `unreadable`, never dropped silently. The merged
evidence read is in proxy/cluster/evidence.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.cluster.fanout import PEER_CLIENT, admin_headers, call_peer
from proxy.cluster.peers import Peer, PeerSet, discover_peers
from proxy.config import SETTINGS
from proxy.errors import error_response
from proxy.isolation.merge import merged_isolation

__all__ = ["READ_TIMEOUT_S", "cluster_state", "error_message", "no_peers"]

READ_TIMEOUT_S = 30.0
_STATE_READ_LIMIT = 1024 * 1024


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


def error_message(raw: bytes) -> str:
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
    """GET `path` from one pod, bounded in time and size."""
    reply = await call_peer(
        session,
        "GET",
        f"{peer.base_url}{path}",
        headers=headers,
        deadline=deadline,
        limit=limit,
        tls_name=peer.tls_name,
    )
    url, status, body = reply.url, reply.status, reply.body
    if reply.timed_out:
        return PodRead(peer.address, url, None, error=f"no answer within {READ_TIMEOUT_S:g} s")
    if status is None:
        return PodRead(peer.address, url, None, error=reply.error)
    if status != 200:
        return PodRead(peer.address, url, status, error=f"HTTP {status}: {error_message(body)}")
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


def no_peers(peers: PeerSet) -> web.Response:
    """502: an empty peer set is never an empty success."""
    message = f"no peers to read ({peers.source}): {peers.error}; {peers.hint}"
    return error_response(502, message, type_="cluster_error", code="no_peers")


async def cluster_state(request: web.Request) -> web.Response:
    """Every pod's `/cache/state`, each under its pod, and the pods that could not be read."""
    peers, reads = await _read_all(request, "/cache/state", _STATE_READ_LIMIT)
    if not peers.peers:
        return no_peers(peers)
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
    isolation = merged_isolation(
        (pod["pod"], pod["state"].get("isolation")) for pod in pods if isinstance(pod["state"], dict)
    )
    return web.json_response(
        {
            "scope": "cluster",
            "peers_source": peers.source,
            "pods": pods,
            "unreadable": unreadable,
            "verdicts": verdicts,
            "isolation": isolation,
        }
    )
