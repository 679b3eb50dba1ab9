"""`GET /cache/evidence?scope=cluster`: every pod's matching lines, merged by `at_ns` as they stream in.

Each pod writes its evidence in time order, so a k-way merge of the pods' streams is in time
order too, and holds one line per pod in memory, whatever the evidence's size. Each line is
tagged with its `pod`; a trailing `cachewitness.cluster_read` line names the pods read and
those that could not be (never dropped silently), including one that broke off part-way.

Each pod is asked for its proof (`?proof=1`, proxy/evidence/proof.py): the chain segments
around the matching records, checked here line by line as they pass (every link, seq,
count and signature), then filtered. The trailer names each pod whose chain is whole
(`chains_verified`) and each chain that is not (`broken_chains`). With `proof=1` the pods'
proofs go out as they are, one pod after the other, for `cachewitness evidence bundle`.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.cluster.fanout import PEER_CLIENT, admin_headers, peer_error
from proxy.cluster.peers import Peer, discover_peers
from proxy.cluster.state import error_message, no_peers
from proxy.config import SETTINGS
from proxy.evidence.lines import MAX_LINE_BYTES
from proxy.evidence.proof import ProofRouter, pod_marker
from proxy.evidence.reader import record_matches
from proxy.evidence.verify import ChainCheck
from proxy.vocabulary import EventType

__all__ = ["READ_IDLE_TIMEOUT_S", "cluster_evidence", "cluster_proof"]

# A pod that sends nothing for this long is named unreadable (a large read itself may take longer).
READ_IDLE_TIMEOUT_S = 30.0
# Matching lines go out in writes of about this size.
_WRITE_BYTES = 64 * 1024


@dataclass
class _PodStream:
    """One pod's evidence answer, read a line at a time; `error` once it failed."""

    pod: str
    url: str
    response: aiohttp.ClientResponse | None = None
    status: int | None = None
    error: str | None = None
    records: int = 0
    unparsed: int = 0
    filters: dict[str, Any] = field(default_factory=dict)
    _carry: bytes = b""
    _lines: collections.deque[bytes] = field(default_factory=collections.deque)
    _router: ProofRouter = field(default_factory=lambda: ProofRouter(""))
    _checks: dict[str, ChainCheck] = field(default_factory=dict)
    _numbers: dict[str, int] = field(default_factory=dict)
    _outside: int = 0  # lines of no chain segment (an answer that is no proof)

    def unreadable(self) -> dict[str, Any]:
        """The trailer's entry for this pod."""
        return {"pod": self.pod, "url": self.url, "status": self.status, "error": self.error}

    async def _line(self) -> bytes | None:
        """The next line, None at the end; a read that fails or stalls sets `error`."""
        assert self.response is not None
        while not self._lines:
            try:
                async with asyncio.timeout(READ_IDLE_TIMEOUT_S):
                    chunk = await self.response.content.readany()
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                what = f"silent for {READ_IDLE_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError) else str(exc)
                self.error = f"the read broke off after {self.records} records: {what}"
                return None
            if not chunk:
                if self._carry.strip():
                    self.unparsed += 1  # a last line without its newline was cut
                self._carry = b""
                return None
            *complete, self._carry = (self._carry + chunk).split(b"\n")
            self._lines.extend(complete)
            if len(self._carry) > MAX_LINE_BYTES:
                self.error = f"a line over {MAX_LINE_BYTES} bytes after {self.records} records"
                return None
        return self._lines.popleft()

    def check(self, line: bytes) -> bool:
        """Check one line of the pod's proof (its exact bytes) in its chain; False for a control line."""
        control, chain = self._router.route(line)
        if control:
            return False
        if chain is None:
            self._outside += 1
            return True
        check = self._checks.get(chain)
        if check is None:
            check = self._checks[chain] = ChainCheck(f"{self.pod}/{chain}")
        # Lines are numbered within the pod's proof of this chain.
        self._numbers[chain] = number = self._numbers.get(chain, 0) + 1
        check.feed(line, f"{self.pod}/{chain}", number)
        return True

    def chains(self) -> list[dict[str, Any]]:
        """What is wrong with each of this pod's chains, as the trailer names it (empty: all whole)."""
        broken: list[dict[str, Any]] = []
        for chain, check in sorted(self._checks.items()):
            report = check.finish()
            if report.problems:
                broken.append({"pod": self.pod, "file": chain, "problems": list(report.problems[:10])})
        if self._outside or self.pod not in self._router.trailers:
            why = f"{self._outside} lines outside any chain segment; " if self._outside else ""
            broken.append({"pod": self.pod, "file": None, "problems": [why + "the proof did not end whole"]})
        return broken

    async def next_record(self) -> dict[str, Any] | None:
        """The next matching record tagged with `pod`, None at the end (or on error)."""
        while (line := await self._line()) is not None:
            if not line.strip() or not self.check(line + b"\n"):
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                record = None
            if not isinstance(record, dict):
                self.unparsed += 1
                continue
            if not record_matches(record, **self.filters):
                continue
            record["pod"] = self.pod
            self.records += 1
            return record
        return None


async def _open(session: aiohttp.ClientSession, peer: Peer, path: str, headers: dict[str, str]) -> _PodStream:
    """Start one pod's read; a pod that does not answer 200 comes back with `error` set."""
    stream = _PodStream(peer.address, f"{peer.base_url}{path}")
    stream._router.pod = peer.address
    try:
        async with asyncio.timeout(READ_IDLE_TIMEOUT_S):
            response = await session.get(
                stream.url, headers=headers, allow_redirects=False, server_hostname=peer.tls_name
            )
    except TimeoutError:
        stream.error = f"no answer within {READ_IDLE_TIMEOUT_S:g} s"
        return stream
    except (aiohttp.ClientError, OSError) as exc:
        stream.error = peer_error(exc)
        return stream
    stream.status = response.status
    if response.status != 200:
        try:
            body = await response.content.read(4096)
        except (aiohttp.ClientError, OSError):
            body = b""
        response.close()
        stream.error = f"HTTP {response.status}: {error_message(body)}"
        return stream
    stream.response = response
    return stream


def _at_ns(record: dict[str, Any]) -> int:
    """The merge key (a record without a numeric `at_ns` sorts first)."""
    value = record.get("at_ns")
    return value if isinstance(value, int) else 0


def _proof_path(filters: Mapping[str, str], kind: str = "1") -> str:
    return "/cache/evidence?" + urllib.parse.urlencode({**filters, "proof": kind})


def _filters(filters: Mapping[str, str]) -> dict[str, Any]:
    """The query's filters as the reader takes them (the receiving pod has checked them)."""
    return {k: int(v) if k == "since_ns" else v for k, v in filters.items()}


def _trailer(source: str, streams: list[_PodStream]) -> bytes:
    """The `cachewitness.cluster_read` line: the pods read, those not, and whose chains are whole."""
    read = [s for s in streams if s.error is None]
    broken = {s.pod: s.chains() for s in read}
    trailer = {
        "schema_version": 1,
        "event_type": str(EventType.CLUSTER_READ),
        "at_ns": time.time_ns(),
        "scope": "cluster",
        "peers_source": source,
        "pods_read": [s.pod for s in read],
        "unreadable": [s.unreadable() for s in streams if s.error is not None],
        "records": sum(s.records for s in streams),
        "unparsed_lines": sum(s.unparsed for s in streams),
        "chains_verified": [pod for pod, chains in broken.items() if not chains],
        "broken_chains": [chain for chains in broken.values() for chain in chains],
    }
    return orjson.dumps(trailer, option=orjson.OPT_APPEND_NEWLINE)


async def cluster_proof(
    request: web.Request, filters: Mapping[str, str], kind: str = "1"
) -> web.StreamResponse:
    """Every pod's proof for `filters`, one pod after the other, then the trailer. Chain segments
    (`kind` 1) are checked as they pass; Merkle proofs (`inclusion`) pass as they are: the
    reader checks them against the pods' signed checkpoints."""
    settings = request.app[SETTINGS]
    peers = await discover_peers(settings)
    if not peers.peers:
        return no_peers(peers)
    headers = admin_headers(settings)
    session = request.app[PEER_CLIENT]
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    streams: list[_PodStream] = []
    for peer in peers.peers:  # one at a time: a pod waiting its turn would time out
        stream = await _open(session, peer, _proof_path(filters, kind), headers)
        streams.append(stream)
        if stream.response is None:
            continue
        try:
            batch, size = [pod_marker(stream.pod)], 0
            while (line := await stream._line()) is not None:
                raw = line + b"\n"
                if kind == "1":
                    stream.check(raw)
                batch.append(raw)
                size += len(raw)
                if size >= _WRITE_BYTES:
                    await response.write(b"".join(batch))
                    batch, size = [], 0
            await response.write(b"".join(batch))
        finally:
            stream.response.close()
    await response.write(_trailer(peers.source, streams))
    await response.write_eof()
    return response


async def cluster_evidence(request: web.Request, filters: Mapping[str, str]) -> web.StreamResponse:
    """Every pod's lines for `filters`, merged by `at_ns`, each tagged with `pod`, then the trailer."""
    settings = request.app[SETTINGS]
    peers = await discover_peers(settings)
    if not peers.peers:
        return no_peers(peers)
    headers = admin_headers(settings)
    session = request.app[PEER_CLIENT]
    path = _proof_path(filters)
    streams = list(await asyncio.gather(*(_open(session, peer, path, headers) for peer in peers.peers)))
    for stream in streams:
        stream.filters = _filters(filters)
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    try:
        await response.prepare(request)
        heap: list[tuple[int, int, int, dict[str, Any]]] = []
        sequence = 0  # ties keep each pod's own order
        for index, stream in enumerate(streams):
            if stream.response is not None and (record := await stream.next_record()) is not None:
                heapq.heappush(heap, (_at_ns(record), sequence, index, record))
                sequence += 1
        batch: list[bytes] = []
        size = 0
        while heap:
            _, _, index, record = heapq.heappop(heap)
            line = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
            batch.append(line)
            size += len(line)
            if size >= _WRITE_BYTES:
                await response.write(b"".join(batch))
                batch, size = [], 0
            if (following := await streams[index].next_record()) is not None:
                heapq.heappush(heap, (_at_ns(following), sequence, index, following))
                sequence += 1
        batch.append(_trailer(peers.source, streams))
        await response.write(b"".join(batch))
        await response.write_eof()
    finally:
        for stream in streams:
            if stream.response is not None:
                stream.response.close()
    return response
