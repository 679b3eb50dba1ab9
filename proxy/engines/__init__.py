"""Engine dialects: one module per engine kind, shared outcome types in base, detection in detect."""

from __future__ import annotations

from proxy.engines.base import Attempt, CacheReset, Dialect, EngineInfo
from proxy.engines.call import EngineCall
from proxy.engines.detect import detect_engine

__all__ = ["Attempt", "CacheReset", "Dialect", "EngineCall", "EngineInfo", "detect_engine"]
