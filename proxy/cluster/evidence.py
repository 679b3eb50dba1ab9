"""`GET /cache/evidence?scope=cluster`: every pod's matching lines, merged by `at_ns` as they stream in.

Each pod writes its evidence in time order, so a k-way merge of the pods' streams is in time
order too, and holds one line per pod in memory, whatever the evidence's size. Each line is
tagged with its `pod`; a trailing `cachewitness.cluster_read` line names the pods read and
those that could not be (never dropped silently), including one that broke off part-way.
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
from proxy.evidence.writer import MAX_LINE_BYTES
from proxy.vocabulary import EventType

__all__ = ["READ_IDLE_TIMEOUT_S", "cluster_evidence"]

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
    _carry: bytes = b""
    _lines: collections.deque[bytes] = field(default_factory=collections.deque)

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

    async def next_record(self) -> dict[str, Any] | None:
        """The next record tagged with `pod`, None at the end (or on error)."""
        while (line := await self._line()) is not None:
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                record = None
            if not isinstance(record, dict):
                self.unparsed += 1
                continue
            record["pod"] = self.pod
            self.records += 1
            return record
        return None


async def _open(session: aiohttp.ClientSession, peer: Peer, path: str, headers: dict[str, str]) -> _PodStream:
    """Start one pod's read; a pod that does not answer 200 comes back with `error` set."""
    stream = _PodStream(peer.address, f"{peer.base_url}{path}")
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


async def cluster_evidence(request: web.Request, filters: Mapping[str, str]) -> web.StreamResponse:
    """Every pod's lines for `filters`, merged by `at_ns`, each tagged with `pod`, then the trailer."""
    settings = request.app[SETTINGS]
    peers = await discover_peers(settings)
    if not peers.peers:
        return no_peers(peers)
    query = urllib.parse.urlencode(dict(filters))
    path = "/cache/evidence" + (f"?{query}" if query else "")
    headers = admin_headers(settings)
    session = request.app[PEER_CLIENT]
    streams = list(await asyncio.gather(*(_open(session, peer, path, headers) for peer in peers.peers)))
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
        trailer = {
            "schema_version": 1,
            "event_type": str(EventType.CLUSTER_READ),
            "at_ns": time.time_ns(),
            "scope": "cluster",
            "peers_source": peers.source,
            "pods_read": [s.pod for s in streams if s.error is None],
            "unreadable": [s.unreadable() for s in streams if s.error is not None],
            "records": sum(s.records for s in streams),
            "unparsed_lines": sum(s.unparsed for s in streams),
        }
        batch.append(orjson.dumps(trailer, option=orjson.OPT_APPEND_NEWLINE))
        await response.write(b"".join(batch))
        await response.write_eof()
    finally:
        for stream in streams:
            if stream.response is not None:
                stream.response.close()
    return response
