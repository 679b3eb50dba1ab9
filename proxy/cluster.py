"""`POST /cache/reset` with `scope: "cluster"`: every peer resets its own engine, one answer for all.

The receiving pod calls `/cache/reset` with `scope: "pod"` on every peer, itself included,
concurrently and under one shared deadline, with the caller's parameters, the admin token
(every pod mounts the same Secret) and the cluster `reset_id` as `parent_reset_id`, so
each pod's own record points back at this one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.config import SETTINGS, Settings
from proxy.engines.base import (
    ACCEPTED_UNVERIFIED,
    ACKNOWLEDGED,
    ERROR,
    REFUSED,
    UNREACHABLE,
    UNSUPPORTED,
    CacheReset,
    cache_state_record,
)
from proxy.logs import log_event
from proxy.peers import Peer, PeerSet, discover_peers
from proxy.recorder import RECORDER
from proxy.reset_params import POD, ResetParams
from proxy.verification import Verified

__all__ = [
    "PEER_CLIENT",
    "ClusterReset",
    "PodReset",
    "Verified",
    "admin_headers",
    "cluster_reset",
    "cluster_timeout_s",
    "setup_cluster",
]

log = logging.getLogger("cachewitness.cluster")

PARTIAL = "partial"
CONTRADICTED = "contradicted"
# Beyond the worst case of one pod's reset (drain + retries + last attempt): connect, answer, record.
CLUSTER_SLACK_S = 10.0
# A pod's reset answer lists its engine calls (bounded by reset.py); more than this is not an answer.
_ANSWER_READ_LIMIT = 1024 * 1024


PEER_CLIENT = web.AppKey("peer_client", aiohttp.ClientSession)


@dataclass(frozen=True)
class PodReset:
    """One peer's part of a cluster reset: what it answered, or why it could not."""

    pod: str
    url: str
    status: int | None
    answer: str
    verified: Verified
    reset_id: str | None
    error: str | None = None
    canary_ran: bool = False
    hint: str | None = None

    @property
    def unknown(self) -> bool:
        """Nobody knows whether this pod's engine was reset: the pod or its engine was not reached."""
        return self.answer in (UNREACHABLE, ERROR)

    @property
    def contradicted(self) -> bool:
        """The pod's canary saw cached tokens after the reset."""
        return self.answer == CONTRADICTED or self.verified == Verified.CONTRADICTED

    @property
    def confirmed(self) -> bool:
        """Acknowledged, and verified where a canary ran."""
        return self.answer == ACKNOWLEDGED and (not self.canary_ran or self.verified == Verified.VERIFIED)

    def to_json(self) -> dict[str, Any]:
        """The entry of the answer's and the record's `pods` list."""
        entry: dict[str, Any] = {
            "pod": self.pod,
            "url": self.url,
            "status": self.status,
            "answer": self.answer,
            "verified": self.verified.value,
            "reset_id": self.reset_id,
            "error": self.error,
        }
        if self.hint:
            entry["hint"] = self.hint
        return entry


@dataclass(frozen=True)
class ClusterReset:
    """A whole cluster reset: its id, the peers it reached for, and each pod's part."""

    reset_id: str
    peers: PeerSet
    pods: tuple[PodReset, ...]
    at_ns: int
    answered_at_ns: int
    deadline_s: float

    @property
    def answer(self) -> str:
        """The cluster's word: the worst pod decides (SPEC §12.4, issue 15)."""
        pods = self.pods
        if not pods:
            return ERROR
        if any(pod.unknown for pod in pods):
            return PARTIAL
        if any(pod.contradicted for pod in pods):
            return CONTRADICTED
        if any(pod.answer == REFUSED for pod in pods):
            return REFUSED
        if any(pod.answer == UNSUPPORTED for pod in pods):
            return UNSUPPORTED
        if all(pod.confirmed for pod in pods):
            return ACKNOWLEDGED
        # Accepted everywhere, but some pod could not confirm it (an empty 2xx, an inconclusive canary).
        return ACCEPTED_UNVERIFIED

    @property
    def http_status(self) -> int:
        """200 all accepted, 409 refused or contradicted, 501 unsupported, 502 partial or no peers."""
        return {
            ACKNOWLEDGED: 200,
            ACCEPTED_UNVERIFIED: 200,
            CONTRADICTED: 409,
            REFUSED: 409,
            UNSUPPORTED: 501,
        }.get(self.answer, 502)

    @property
    def verified(self) -> Verified:
        """Contradicted if any pod was, verified if every pod was, else unverified."""
        if any(pod.contradicted for pod in self.pods):
            return Verified.CONTRADICTED
        if self.pods and all(pod.verified == Verified.VERIFIED for pod in self.pods):
            return Verified.VERIFIED
        return Verified.UNVERIFIED

    @property
    def error(self) -> str | None:
        """What went wrong, naming the pods; None when every pod accepted."""
        if not self.pods:
            return f"{ERROR}: {self.peers.error or 'no peers'}"
        failed = [pod for pod in self.pods if pod.answer not in (ACKNOWLEDGED, ACCEPTED_UNVERIFIED)]
        failed += [pod for pod in self.pods if pod.contradicted and pod not in failed]
        if not failed:
            return None
        named = "; ".join(
            f"{pod.pod} {pod.answer}" + (f" ({pod.error})" if pod.error else "") for pod in failed
        )
        return f"{self.answer}: {len(failed)} of {len(self.pods)} pods: {named}"

    @property
    def hint(self) -> str | None:
        """How to fix what failed."""
        if not self.pods:
            return self.peers.hint
        answer = self.answer
        if answer == PARTIAL:
            return (
                "a pod named unreachable may be restarting or not serving; its engine may still hold its "
                "cache: retry the cluster reset, or read that pod's /cache/state"
            )
        if answer in (REFUSED, CONTRADICTED):
            return "see each pod's answer; a refused pod was busy past retry_seconds (raise it, or drain)"
        if answer == UNSUPPORTED:
            return next((pod.hint for pod in self.pods if pod.hint), None)
        return None

    def cache_state(self, params: ResetParams) -> dict[str, Any]:
        """The receiving pod's `infer.cache_state` record for the whole cluster: the reference's shape,
        `scope: "cluster"` and the per-pod list."""
        answer = self.answer
        reset = CacheReset(
            url="",
            at_ns=self.at_ns,
            status=self.http_status,
            error=self.error,
            attempts=1,
            answered_at_ns=self.answered_at_ns,
            outcome=answer,
        )
        record = cache_state_record(
            session_id=params.session_id,
            case_id=params.case_id,
            requested=params.requested,
            reset=reset,
            warmup_requests=params.warmup_requests,
            reset_id=self.reset_id,
            engine=None,
            at_ns=self.answered_at_ns,
        )
        record["reset"]["url"] = None  # many URLs: each pod's is in `pods`
        record["verified"] = self.verified.value
        record["scope"] = "cluster"
        record["via"] = "cluster"
        record["peers_source"] = self.peers.source
        record["pods"] = [pod.to_json() for pod in self.pods]
        return record

    def to_json(self, params: ResetParams, record: dict[str, Any]) -> dict[str, Any]:
        """The answer's body."""
        body: dict[str, Any] = {}
        answer = self.answer
        if answer != ACCEPTED_UNVERIFIED:
            # As for one pod: absent, not null, when unconfirmed.
            body["success"] = answer == ACKNOWLEDGED
        body.update(
            {
                "answer": answer,
                "scope": "cluster",
                "reset_id": self.reset_id,
                "pods": [pod.to_json() for pod in self.pods],
                "peers_source": self.peers.source,
                "at_ns": self.at_ns,
                "answered_at_ns": self.answered_at_ns,
                "deadline_s": self.deadline_s,
                "session_id": params.session_id,
                "case_id": params.case_id,
                "cache_state": record,
            }
        )
        if self.error:
            body["detail"] = self.error
        if self.hint:
            body["hint"] = self.hint
        return body


def cluster_timeout_s(settings: Settings, params: ResetParams) -> float:
    """The shared deadline: one pod's worst case (drain, two retry windows as reset.py holds, last attempt)."""
    drain = settings.drain_timeout if params.drain else 0.0
    return drain + 2 * params.retry_seconds + settings.reset_attempt_timeout + CLUSTER_SLACK_S


def admin_headers(settings: Settings) -> dict[str, str]:
    """The admin token for calls to peers: every pod of the Deployment mounts the same Secret."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if settings.admin_token:
        headers["Authorization"] = f"Bearer {settings.admin_token}"
    return headers


def _pod_body(params: ResetParams, reset_id: str) -> bytes:
    """The caller's parameters for one pod: scope pod, this cluster reset as parent."""
    values = dataclasses.asdict(params)
    values.update(scope=POD, parent_reset_id=reset_id)
    return orjson.dumps({name: value for name, value in values.items() if value is not None})


def _unreached(peer: Peer, url: str, error: str) -> PodReset:
    """A pod that gave no reset answer."""
    return PodReset(peer.address, url, None, UNREACHABLE, Verified.UNVERIFIED, None, error)


def _pod_answer(peer: Peer, url: str, status: int, raw: bytes) -> PodReset:
    """A pod's part from its HTTP answer; an answer that is not a reset answer is an error."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("answer"), str):
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        if not isinstance(message, str):
            message = raw[:200].decode("utf-8", errors="replace") or "(no body)"
        return PodReset(
            peer.address, url, status, ERROR, Verified.UNVERIFIED, None, f"HTTP {status}: {message}"
        )
    verification = body.get("verification")
    try:
        verified = Verified(body.get("verified", Verified.UNVERIFIED))
    except ValueError:
        verified = Verified.UNVERIFIED
    return PodReset(
        peer.address,
        url,
        status,
        body["answer"],
        verified,
        body.get("reset_id") if isinstance(body.get("reset_id"), str) else None,
        error=body.get("detail") if isinstance(body.get("detail"), str) else None,
        canary_ran=isinstance(verification, dict) and verification.get("method") == "canary",
        hint=body.get("hint") if isinstance(body.get("hint"), str) else None,
    )


async def _reset_pod(
    session: aiohttp.ClientSession,
    peer: Peer,
    body: bytes,
    headers: dict[str, str],
    deadline: float,
    timeout_s: float,
) -> PodReset:
    """One pod's reset, bounded by the shared deadline; never raises (except cancellation)."""
    url = f"{peer.base_url}/cache/reset"
    try:
        async with asyncio.timeout_at(deadline):
            async with session.post(url, data=body, headers=headers, allow_redirects=False) as response:
                raw = await response.content.read(_ANSWER_READ_LIMIT)
                return _pod_answer(peer, url, response.status, raw)
    except TimeoutError:
        return _unreached(peer, url, f"no answer within the cluster deadline of {timeout_s:g} s")
    except (aiohttp.ClientError, OSError) as exc:
        return _unreached(peer, url, f"cannot reach the pod: {type(exc).__name__}: {exc}")


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


def peer_client(settings: Settings) -> aiohttp.ClientSession:
    """The pool toward the other sidecars (not the engine's pool: other limits, other lifetime)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=False),
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
