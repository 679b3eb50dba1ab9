"""What the sidecar reads from the engine besides resets: its `/metrics` text and its `/v1/models` ids.

Both metrics (the merged exposition, the `model` label) and the canary (the model to ask,
vLLM's block size) read them, so the fetchers stand here, below both.
"""

from __future__ import annotations

import aiohttp
import orjson

from proxy.engines.call import bearer

__all__ = ["fetch_engine_metrics", "fetch_model_ids", "read_limited"]

# What the merge asks the engine for: the text format, as ours.
_ENGINE_ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
_EXPOSITION_TYPES = frozenset({"text/plain", "application/openmetrics-text"})
_ENGINE_METRICS_LIMIT = 32 * 1024 * 1024  # a vLLM exposition with many LoRA/histograms is a few MiB
_MODELS_LIMIT = 1024 * 1024
_MODEL_ID_MAX = 256


async def read_limited(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` bytes."""
    parts: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


async def fetch_engine_metrics(
    session: aiohttp.ClientSession, base: str, timeout_s: float, path: str = "/metrics"
) -> bytes | None:
    """The engine's Prometheus text (at `path`) as it sent it, or None when it has none (non-200),
    is down, or is too slow."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Accept": _ENGINE_ACCEPT, "Accept-Encoding": "identity"}
    try:
        async with session.get(
            base + path, headers=headers, timeout=timeout, allow_redirects=False
        ) as response:
            # The pool does not decompress (auto_decompress=False): only identity text can be merged. An
            # OpenAI-compatible server that answers every path with its web UI must not be merged either.
            if (
                response.status != 200
                or response.content_type not in _EXPOSITION_TYPES
                or response.headers.get("Content-Encoding", "identity") != "identity"
            ):
                return None
            body = await read_limited(response, _ENGINE_METRICS_LIMIT)
    except (TimeoutError, aiohttp.ClientError, OSError, RuntimeError):
        # RuntimeError: the pool closed under a scrape during shutdown.
        return None
    return body


async def fetch_model_ids(
    session: aiohttp.ClientSession, base: str, timeout_s: float, api_key: str | None = None
) -> list[str] | None:
    """The model ids the engine lists at `/v1/models` (OpenAI shape), or None when it cannot say.

    `api_key`: the engine's own key (vLLM `--api-key` guards `/v1/*`), sent as a bearer token.
    """
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(
            base + "/v1/models",
            headers={"Accept": "application/json", **(bearer(api_key) or {})},
            timeout=timeout,
            allow_redirects=False,
        ) as response:
            if response.status != 200:
                return None
            body = await read_limited(response, _MODELS_LIMIT)
    except (TimeoutError, aiohttp.ClientError, OSError, RuntimeError):
        return None
    try:
        data = orjson.loads(body) if body is not None else None
    except orjson.JSONDecodeError:
        return None
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return None
    return [
        entry["id"]
        for entry in entries
        if isinstance(entry, dict)
        and isinstance(entry.get("id"), str)
        and 0 < len(entry["id"]) <= _MODEL_ID_MAX
    ]
