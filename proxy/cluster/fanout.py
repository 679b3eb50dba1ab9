"""`POST /cache/reset` with `scope: "cluster"`: every peer resets its own engine, one answer for all.

The receiving pod calls `/cache/reset` with `scope: "pod"` on every peer, itself included,
concurrently and under one shared deadline, with the caller's parameters, the admin token
(every pod mounts the same Secret) and the cluster `reset_id` as `parent_reset_id`, so
each pod's own record points back at this one. With `peers_scheme = https` the calls go over
TLS, each pod's certificate verified against `peers_ca_file` (docs/cluster.md).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from proxy.cluster.outcome import ClusterReset, PodReset, pod_answer, unreached
from proxy.cluster.peers import Peer, discover_peers
from proxy.config import SETTINGS, Settings
from proxy.logs import log_event
from proxy.recorder import RECORDER
from proxy.reset.params import INPUT_FIELDS, ResetParams, worst_case_seconds
from proxy.vocabulary import Scope, VerifyMode

__all__ = [
    "PEER_CLIENT",
    "PeerReply",
    "admin_headers",
    "call_peer",
    "cluster_reset",
    "cluster_timeout_s",
    "fan_out",
    "peer_error",
    "setup_cluster",
]

log = logging.getLogger("cachewitness.cluster")

# Beyond one pod's worst case (reset_params.worst_case_seconds): connect, answer, record.
CLUSTER_SLACK_S = 10.0
# A pod's reset answer lists its engine calls (bounded by reset.py); more than this is not an answer.
_ANSWER_READ_LIMIT = 1024 * 1024


PEER_CLIENT = web.AppKey("peer_client", aiohttp.ClientSession)


def cluster_timeout_s(settings: Settings, params: ResetParams) -> float:
    """The shared deadline: one pod's worst case, the canary's included when one is asked for."""
    canary = params.verify == VerifyMode.CANARY
    return worst_case_seconds(settings, params, canary=canary) + CLUSTER_SLACK_S


def admin_headers(settings: Settings) -> dict[str, str]:
    """The admin token for calls to peers: every pod of the Deployment mounts the same Secret."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if settings.admin_token:
        headers["Authorization"] = f"Bearer {settings.admin_token}"
    return headers


def _pod_body(params: ResetParams, reset_id: str) -> bytes:
    """The caller's parameters for one pod: scope pod, this cluster reset as parent."""
    # `bind` is refused with scope cluster; left out, a peer of an older version still takes the body.
    values = {name: getattr(params, name) for name in INPUT_FIELDS if name != "bind"}
    values.update(scope=Scope.POD, parent_reset_id=reset_id)
    return orjson.dumps({name: value for name, value in values.items() if value is not None})


def peer_error(exc: aiohttp.ClientError | OSError) -> str:
    """Why a peer could not be reached; a failed certificate check says so and what to set."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        cause = exc.certificate_error
        reason = getattr(cause, "verify_message", None) or str(cause)
        return (
            f"the pod's TLS certificate did not verify ({reason}); peers_ca_file must hold "
            "the CA that signed the peers' certificates, for the name they are called by"
        )
    if isinstance(exc, aiohttp.ClientSSLError):
        return f"TLS with the pod failed: {type(exc).__name__}: {exc}"
    return f"cannot reach the pod: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class PeerReply:
    """One call to a peer sidecar: its status and body (at most `limit` + 1 bytes), or why none came."""

    url: str
    status: int | None
    body: bytes = b""
    error: str | None = None
    timed_out: bool = False


async def call_peer(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    headers: dict[str, str],
    deadline: float,
    limit: int,
    data: bytes | None = None,
    tls_name: str | None = None,
) -> PeerReply:
    """Call a peer before `deadline` (loop time), reading at most `limit` + 1 bytes; never raises
    (except cancellation). Over https the certificate is checked against `tls_name` (else the URL's host)."""
    try:
        async with asyncio.timeout_at(deadline):
            async with session.request(
                method, url, data=data, headers=headers, allow_redirects=False, server_hostname=tls_name
            ) as response:
                return PeerReply(url, response.status, await response.content.read(limit + 1))
    except TimeoutError:
        return PeerReply(url, None, error="no answer before the deadline", timed_out=True)
    except (aiohttp.ClientError, OSError) as exc:
        return PeerReply(url, None, error=peer_error(exc))


async def _reset_pod(
    session: aiohttp.ClientSession,
    peer: Peer,
    body: bytes,
    headers: dict[str, str],
    deadline: float,
    timeout_s: float,
) -> PodReset:
    """One pod's reset, bounded by the shared deadline."""
    url = f"{peer.base_url}/cache/reset"
    reply = await call_peer(
        session,
        "POST",
        url,
        headers=headers,
        deadline=deadline,
        limit=_ANSWER_READ_LIMIT,
        data=body,
        tls_name=peer.tls_name,
    )
    if reply.timed_out:
        return unreached(peer, url, f"no answer within the cluster deadline of {timeout_s:g} s")
    if reply.status is None:
        return unreached(peer, url, reply.error or "no answer")
    return pod_answer(peer, url, reply.status, reply.body)


async def fan_out(
    session: aiohttp.ClientSession,
    settings: Settings,
    params: ResetParams,
    peers: Sequence[Peer],
    reset_id: str,
) -> tuple[tuple[PodReset, ...], float]:
    """Every peer's reset, concurrently, under one deadline; the pods in peer order, and the deadline used."""
    timeout_s = cluster_timeout_s(settings, params)
    deadline = asyncio.get_running_loop().time() + timeout_s
    body = _pod_body(params, reset_id)
    headers = admin_headers(settings)
    pods = await asyncio.gather(
        *(_reset_pod(session, peer, body, headers, deadline, timeout_s) for peer in peers)
    )
    return tuple(pods), timeout_s


async def cluster_reset(request: web.Request, params: ResetParams) -> web.Response:
    """`POST /cache/reset` with scope cluster: fan out, record, answer."""
    app = request.app
    settings = app[SETTINGS]
    reset_id = uuid.uuid4().hex
    at_ns = time.time_ns()
    peers = await discover_peers(settings)
    pods, timeout_s = await fan_out(app[PEER_CLIENT], settings, params, peers.peers, reset_id)
    outcome = ClusterReset(reset_id, peers, pods, at_ns, time.time_ns(), timeout_s)
    record = outcome.cache_state(params)
    app[RECORDER].cluster_reset(record)
    log_event(
        log,
        logging.INFO if outcome.http_status == 200 else logging.WARNING,
        f"cluster cache reset {outcome.answer}",
        event="cluster_cache_reset",
        reset_id=reset_id,
        answer=outcome.answer,
        peers_source=peers.source,
        pods=len(pods),
        pods_failed=sum(1 for pod in pods if not pod.confirmed),
        error=outcome.error,
        duration_s=(outcome.answered_at_ns - at_ns) / 1e9,
    )
    return web.Response(
        status=outcome.http_status,
        body=orjson.dumps(outcome.to_json(params, record)),
        content_type="application/json",
    )


def peer_tls(settings: Settings) -> ssl.SSLContext | bool:
    """Verified TLS toward the peers (peers_ca_file, else the system's CAs); True: aiohttp's default."""
    if settings.peers_scheme != "https":
        return True
    return ssl.create_default_context(cafile=settings.peers_ca_file)


def peer_client(settings: Settings) -> aiohttp.ClientSession:
    """The pool toward the other sidecars (not the engine's pool: other limits, other lifetime)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=False, ssl=peer_tls(settings)),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout or None),
        trust_env=False,  # no environment proxy between pods
        cookie_jar=aiohttp.DummyCookieJar(),
        raise_for_status=False,
    )


def setup_cluster(app: web.Application) -> None:
    """Own the peer client for the app's life."""

    async def _peer_pool(app: web.Application) -> AsyncIterator[None]:
        session = peer_client(app[SETTINGS])
        app[PEER_CLIENT] = session
        yield
        await session.close()

    app.cleanup_ctx.append(_peer_pool)
