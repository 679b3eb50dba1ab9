"""LMCache beside vLLM: finding each vLLM process's internal API server, and clearing its tiers there.

LMCache 0.5.6 (lmcache/v1/internal_api_server/api_server.py) serves one API per vLLM process
when `internal_api_server_enabled`: port `internal_api_server_port_start` (default 6999) + 0 for
the scheduler, + 1 + worker id for each worker. `DELETE /cache/clear` (vllm/cache_api.py) clears
every location when none is named and answers 200 `{"status": "success", "num_removed": N}`;
the scheduler holds no cache engine and answers 503 `{"error": "LMCache API is unavailable"}`.
A success proves little (LMCache #1692, #1693: success with nothing cleared; #1660: the disk
tier left): the canary and `lmcache:num_hit_tokens` judge it (proxy/reset/layout.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import StrEnum

import aiohttp
from yarl import URL

from proxy.engines.call import EngineCall, engine_call

__all__ = ["AUTO", "AUTO_PORT_START", "ClearResult", "TierOutcome", "clear_tier", "find_servers"]

AUTO = "auto"
AUTO_PORT_START = 6999  # LMCache's default internal_api_server_port_start
_AUTO_PORTS = 9  # the scheduler and up to eight workers (tensor parallel 8)
_PROBE_TIMEOUT_S = 2.0
_UNAVAILABLE = "LMCache API is unavailable"


class TierOutcome(StrEnum):
    """What one internal API server did with a clear."""

    CLEARED = "cleared"  # 2xx `{"status": "success"}`
    NO_ENGINE = "no_engine"  # the scheduler's server: no cache there to clear
    FAILED = "failed"  # no answer, or anything else


@dataclass(frozen=True)
class ClearResult:
    """One server's clear: its outcome, `num_removed` where it said, and the call."""

    base_url: str
    outcome: TierOutcome
    removed: int | None
    call: EngineCall


async def find_servers(
    session: aiohttp.ClientSession, upstream_base: str, configured: tuple[str, ...], timeout_s: float
) -> tuple[str, ...]:
    """The configured base URLs; for `auto`, those of the upstream host's ports from 6999 that answer `/lmc_version`."""
    if configured != (AUTO,):
        return tuple(url.rstrip("/") for url in configured)
    host = URL(upstream_base).host or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    bases = [f"http://{host}:{AUTO_PORT_START + offset}" for offset in range(_AUTO_PORTS)]
    timeout = min(timeout_s, _PROBE_TIMEOUT_S)
    replies = await asyncio.gather(
        *(engine_call(session, "GET", base + "/lmc_version", timeout_s=timeout) for base in bases)
    )
    return tuple(base for base, reply in zip(bases, replies, strict=True) if reply.status == 200)


async def clear_tier(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> ClearResult:
    """`DELETE /cache/clear` (every location) at one internal API server."""
    reply = await engine_call(session, "DELETE", base_url + "/cache/clear", timeout_s=timeout_s)
    payload = reply.json()
    if reply.status == 503 and isinstance(payload, dict) and payload.get("error") == _UNAVAILABLE:
        return ClearResult(base_url, TierOutcome.NO_ENGINE, None, reply.call)
    ok = reply.status is not None and 200 <= reply.status < 300
    if ok and isinstance(payload, dict) and payload.get("status") == "success":
        removed = payload.get("num_removed")
        count = removed if isinstance(removed, int) and not isinstance(removed, bool) else None
        return ClearResult(base_url, TierOutcome.CLEARED, count, reply.call)
    return ClearResult(base_url, TierOutcome.FAILED, None, reply.call)
