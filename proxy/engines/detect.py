"""`--engine auto`: which engine answers at the upstream, probed in the order of docs/engines.md."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from proxy.engines.base import Attempt, AttemptPlan, Dialect, EngineInfo
from proxy.engines.call import engine_call
from proxy.engines.modes import llamacpp_mode, vllm_mode
from proxy.redact import redact_url
from proxy.vocabulary import EngineKind, ResetAnswer

__all__ = ["UndetectedDialect", "detect_engine", "probe_info", "probe_version"]

# The upstream did not answer: the kind is pending re-detection.


class _Unreachable(Exception):
    """A probe got no HTTP answer: stop probing, the upstream is down or hanging."""


class _Prober:
    """GETs JSON from the upstream, each probe bounded by the timeout."""

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, timeout_s: float, api_key: str | None
    ) -> None:
        """Probe `base_url` through `session`, each call bounded by `timeout_s`."""
        self._session = session
        self._base_url = base_url.rstrip("/")
        self._timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None

    async def json(self, path: str) -> Any:
        """The JSON body of a 200 answer to GET `path`; None for any other answer."""
        reply = await engine_call(
            self._session, "GET", f"{self._base_url}{path}", timeout_s=self._timeout_s, headers=self._headers
        )
        if reply.status is None:
            # A timeout counts too: probing on would multiply a hanging engine's wait.
            raise _Unreachable(reply.call.error)
        return reply.json() if reply.status == 200 else None


def _text(value: Any) -> str | None:
    """A version value as text (engines report strings; a number is tolerated)."""
    if isinstance(value, bool) or value is None:
        return None
    return str(value) if isinstance(value, (str, int, float)) else None


async def _llamacpp(probe: _Prober) -> EngineInfo | None:
    """llama-server: `/props` has `build_info` or `total_slots`."""
    props = await probe.json("/props")
    if isinstance(props, dict) and ("build_info" in props or "total_slots" in props):
        return EngineInfo(EngineKind.LLAMACPP, _text(props.get("build_info")), llamacpp_mode(props))
    return None


async def _sglang(probe: _Prober) -> EngineInfo | None:
    """SGLang: `/server_info` (0.5.10+) or `/get_server_info` (0.4+) has `version`."""
    for path in ("/server_info", "/get_server_info"):
        info = await probe.json(path)
        if isinstance(info, dict) and "version" in info:
            return EngineInfo(EngineKind.SGLANG, _text(info["version"]))
    return None


def _owners(models: Any) -> set[str]:
    """The `owned_by` values of a `/v1/models` answer."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return set()
    return {m["owned_by"] for m in data if isinstance(m, dict) and isinstance(m.get("owned_by"), str)}


async def _versioned(probe: _Prober) -> EngineInfo | None:
    """vLLM or TensorRT-LLM: both answer `/version` with `{"version"}`; `/v1/models` `owned_by` tells them apart.

    vLLM's cards say `vllm`, trtllm-serve's `tensorrt_llm` (tensorrt_llm/serve/openai_protocol.py, ModelCard).
    """
    version = await probe.json("/version")
    if not isinstance(version, dict) or "version" not in version:
        return None
    owners = _owners(await probe.json("/v1/models"))
    if "vllm" in owners:
        return EngineInfo(EngineKind.VLLM, _text(version["version"]), vllm_mode(version))
    if "tensorrt_llm" in owners:
        return EngineInfo(EngineKind.TRTLLM, _text(version["version"]))
    return None


async def _dynamo(probe: _Prober) -> EngineInfo | None:
    """Dynamo's frontend has no `/version`: its `/health` lists `endpoints` and `instances`.

    (lib/llm/src/http/service/health.rs; seen on ai-dynamo 1.6.1.) `/health` is 503 while
    discovery runs, so `/live` answering `live` with `/v1/models` owned by `nvidia` counts too.
    """
    health = await probe.json("/health")
    if isinstance(health, dict) and isinstance(health.get("instances"), list) and "endpoints" in health:
        return EngineInfo(EngineKind.DYNAMO)
    live = await probe.json("/live")
    if (
        isinstance(live, dict)
        and live.get("status") == "live"
        and "nvidia" in _owners(await probe.json("/v1/models"))
    ):
        return EngineInfo(EngineKind.DYNAMO)
    return None


async def _mindnano(probe: _Prober) -> EngineInfo | None:
    """mindnano: `/health` has `active`."""
    health = await probe.json("/health")
    if isinstance(health, dict) and "active" in health:
        return EngineInfo(EngineKind.MINDNANO, _text(health.get("version")))
    return None


_PROBES: dict[str, Callable[[_Prober], Awaitable[EngineInfo | None]]] = {
    EngineKind.LLAMACPP: _llamacpp,
    EngineKind.SGLANG: _sglang,
    EngineKind.VLLM: _versioned,
    EngineKind.TRTLLM: _versioned,
    EngineKind.DYNAMO: _dynamo,
    EngineKind.MINDNANO: _mindnano,
}


async def detect_engine(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float, *, api_key: str | None = None
) -> EngineInfo:
    """The engine at `base_url` (llama.cpp, SGLang, vLLM, TensorRT-LLM, Dynamo, mindnano), else generic; `unknown` if unreachable."""
    probe = _Prober(session, base_url, timeout_s, api_key)
    try:
        for check in dict.fromkeys(_PROBES.values()):  # vLLM and TensorRT-LLM share one probe
            info = await check(probe)
            if info is not None:
                return info
    except _Unreachable:
        return EngineInfo(EngineKind.UNKNOWN)
    return EngineInfo(EngineKind.GENERIC)


async def probe_version(
    session: aiohttp.ClientSession,
    base_url: str,
    kind: EngineKind,
    timeout_s: float,
    *,
    api_key: str | None = None,
) -> str | None:
    """Best effort: the version an engine of `kind` reports, None when it does not say. Never raises."""
    info = await probe_info(session, base_url, kind, timeout_s, api_key=api_key)
    return info.version


async def probe_info(
    session: aiohttp.ClientSession,
    base_url: str,
    kind: EngineKind,
    timeout_s: float,
    *,
    api_key: str | None = None,
) -> EngineInfo:
    """Best effort: the version and mode an engine of the configured `kind` reports. Never raises."""
    check = _PROBES.get(kind)
    if check is None:
        return EngineInfo(kind)
    try:
        info = await check(_Prober(session, base_url, timeout_s, api_key))
    except _Unreachable:
        return EngineInfo(kind)
    return EngineInfo(kind, info.version, info.mode) if info is not None else EngineInfo(kind)


UNDETECTED_HINT = "start the engine, or fix --upstream; --engine names its kind when it cannot be detected"


class UndetectedDialect(Dialect):
    """The engine was never reached: no reset can be sent until detection succeeds."""

    kind = EngineKind.UNKNOWN

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """No reset call (its route depends on the kind): one call to say why the engine is not reached."""
        reply = await engine_call(session, "GET", plan.base_url + "/", timeout_s=min(plan.timeout_s, 5.0))
        why = reply.call.error or f"the engine at {redact_url(plan.base_url)} did not answer engine detection"
        return Attempt(
            ResetAnswer.UNREACHABLE, error=why, url=plan.base_url, hint=UNDETECTED_HINT, calls=(reply.call,)
        )
