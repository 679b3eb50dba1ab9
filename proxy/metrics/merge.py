"""The engine's own /metrics: fetched through the pool, made safe to append to the sidecar's exposition."""

from __future__ import annotations

import aiohttp

from proxy.metrics.labels import PREFIX

# What the merge asks the engine for: the text format, as ours.
_ENGINE_ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
_EXPOSITION_TYPES = frozenset({"text/plain", "application/openmetrics-text"})
_ENGINE_METRICS_LIMIT = 32 * 1024 * 1024  # a vLLM exposition with many LoRA/histograms is a few MiB


def engine_exposition(body: bytes) -> bytes:
    """The engine's text, made safe to append to ours.

    Drops OpenMetrics' `# EOF` (it must end the whole exposition, which ours does not) and
    `# UNIT` lines, and any family named like ours (two `# TYPE` lines for one name make
    Prometheus reject the whole scrape).
    """
    if b"# EOF" in body or b"# UNIT" in body or PREFIX.encode() in body:
        kept = [line for line in body.splitlines() if not _foreign_line(line)]
        body = b"\n".join(kept)
    if body and not body.endswith(b"\n"):
        body += b"\n"
    return body


def _foreign_line(line: bytes) -> bool:
    """Whether a line of the engine's text must not reach the merged exposition."""
    stripped = line.strip()
    if stripped == b"# EOF" or stripped.startswith(b"# UNIT "):
        return True
    if stripped.startswith((b"# HELP ", b"# TYPE ")):
        return stripped[7:].lstrip().startswith(PREFIX.encode())
    return stripped.startswith(PREFIX.encode())


async def _read_limited(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` bytes."""
    parts: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


async def fetch_engine_metrics(session: aiohttp.ClientSession, base: str, timeout_s: float) -> bytes | None:
    """The engine's `/metrics` text, or None when it has none (non-200), is down, or is too slow."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Accept": _ENGINE_ACCEPT, "Accept-Encoding": "identity"}
    try:
        async with session.get(
            base + "/metrics", headers=headers, timeout=timeout, allow_redirects=False
        ) as response:
            # The pool does not decompress (auto_decompress=False): only identity text can be merged. An
            # OpenAI-compatible server that answers every path with its web UI must not be merged either.
            if (
                response.status != 200
                or response.content_type not in _EXPOSITION_TYPES
                or response.headers.get("Content-Encoding", "identity") != "identity"
            ):
                return None
            body = await _read_limited(response, _ENGINE_METRICS_LIMIT)
    except (TimeoutError, aiohttp.ClientError, OSError, RuntimeError):
        # RuntimeError: the pool closed under a scrape during shutdown.
        return None
    return engine_exposition(body) if body is not None else None
