"""Typed application keys: the shared objects every handler finds on the app."""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from proxy.admission import Admission
from proxy.config import Settings

if TYPE_CHECKING:
    from proxy.engine_state import EngineState
    from proxy.evidence import EvidenceWriter
    from proxy.health import UpstreamHealth
    from proxy.metrics import Metrics
    from proxy.witness import Witness

__all__ = [
    "ADMISSION",
    "CLIENT",
    "ENGINE",
    "EVIDENCE",
    "HEALTH",
    "METRICS",
    "SETTINGS",
    "WITNESS",
]

SETTINGS = web.AppKey("settings", Settings)
ADMISSION = web.AppKey("admission", Admission)
# The one shared keep-alive pool toward the upstream (set in cleanup_ctx).
CLIENT = web.AppKey("client", aiohttp.ClientSession)
HEALTH: web.AppKey[UpstreamHealth] = web.AppKey("health")
ENGINE: web.AppKey[EngineState] = web.AppKey("engine")
WITNESS: web.AppKey[Witness] = web.AppKey("witness")
EVIDENCE: web.AppKey[EvidenceWriter] = web.AppKey("evidence")
METRICS: web.AppKey[Metrics] = web.AppKey("metrics")
