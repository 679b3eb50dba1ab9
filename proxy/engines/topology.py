"""What an engine says of its own layout at reset time: its data-parallel ranks and SGLang's HiCache storage.

Read once per reset (the layout can change when the engine restarts): SGLang's `/server_info`
(0.5.10+, else `/get_server_info`) has `dp_size` and `hicache_storage_backend`; vLLM labels each
data-parallel engine's samples on `/metrics` with `engine` (vllm/v1/metrics/loggers.py), so the
distinct values are the ranks this API server routes to. Also the SGLang storage tier's clear call.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from proxy.engines.call import EngineCall, bearer, engine_call
from proxy.engines.queries import fetch_engine_metrics
from proxy.vocabulary import EngineKind

__all__ = ["STORAGE_CLEAR_PATH", "Topology", "clear_storage", "read_topology"]

# SGLang's storage-tier clear (http_server.py, ADMIN_OPTIONAL): 200 cleared, 400 refused (busy).
STORAGE_CLEAR_PATH = "/hicache/storage-backend/clear"
_MAX_RANKS = 1024


@dataclass(frozen=True)
class Topology:
    """The engine's data-parallel ranks (one rank: `(0,)`) and its HiCache storage backend, if any."""

    ranks: tuple[int, ...] = (0,)
    storage_backend: str | None = None

    @property
    def multi_rank(self) -> bool:
        """More than one data-parallel rank: each must be confirmed on its own."""
        return len(self.ranks) > 1


async def read_topology(
    session: aiohttp.ClientSession, base_url: str, kind: str, timeout_s: float, api_key: str | None
) -> Topology:
    """The engine's layout, best effort: a single rank and no storage where it does not say."""
    if kind == EngineKind.SGLANG:
        return await _sglang(session, base_url, timeout_s, api_key)
    if kind == EngineKind.VLLM:
        text = await fetch_engine_metrics(session, base_url, timeout_s)
        return Topology(ranks=_vllm_ranks(text.decode("utf-8", "replace") if text else ""))
    return Topology()


async def _sglang(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float, api_key: str | None
) -> Topology:
    """`dp_size` and `hicache_storage_backend` of SGLang's server info."""
    for path in ("/server_info", "/get_server_info"):
        reply = await engine_call(
            session, "GET", base_url + path, timeout_s=timeout_s, headers=bearer(api_key)
        )
        info = reply.json() if reply.status == 200 else None
        if isinstance(info, dict):
            dp = info.get("dp_size")
            size = dp if isinstance(dp, int) and not isinstance(dp, bool) and 1 <= dp <= _MAX_RANKS else 1
            backend = info.get("hicache_storage_backend")
            return Topology(tuple(range(size)), backend if isinstance(backend, str) and backend else None)
    return Topology()


def _vllm_ranks(text: str) -> tuple[int, ...]:
    """The distinct `engine` label values of vLLM's own samples, in order; one rank when none."""
    ranks: set[int] = set()
    try:
        for family in text_string_to_metric_families(text):
            if not family.name.startswith("vllm:"):
                continue
            for sample in family.samples:
                engine = sample.labels.get("engine", "")
                if engine.isdigit() and len(ranks) < _MAX_RANKS:
                    ranks.add(int(engine))
    except ValueError:
        return (0,)
    return tuple(sorted(ranks)) if len(ranks) > 1 else (0,)


async def clear_storage(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float, api_key: str | None
) -> tuple[bool, EngineCall]:
    """SGLang `POST /hicache/storage-backend/clear`: (cleared, the call)."""
    reply = await engine_call(
        session, "POST", base_url + STORAGE_CLEAR_PATH, timeout_s=timeout_s, headers=bearer(api_key)
    )
    return reply.status is not None and 200 <= reply.status < 300, reply.call
