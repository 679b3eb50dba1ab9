"""One bounded HTTP call from the sidecar to the engine, and what it recorded.

Every call the sidecar itself makes to the engine (reset attempts, detection, the canary's
reads) goes through `engine_call`: the URL is kept redacted, the body read bounded, and a
failure becomes a `Reply` without a status instead of an exception. The values built
from calls (`Attempt`, `CacheReset`) are in base.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.redact import redact_url
from proxy.upstream.errors import host_port, os_reason
from proxy.upstream.resend import send_upstream

__all__ = [
    "BODY_EXCERPT_BYTES",
    "EngineCall",
    "Reply",
    "bearer",
    "engine_call",
]

BODY_EXCERPT_BYTES = 2048
# How much of an engine's response is read at all (the reference reads 64 KiB).
_BODY_READ_LIMIT = 64 * 1024


@dataclass(frozen=True)
class EngineCall:
    """One HTTP call made to the engine: URL redacted, body bounded."""

    method: str
    url: str
    status: int | None
    body_excerpt: str
    elapsed_s: float
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The entry of a reset answer's `calls` list."""
        return {
            "method": self.method,
            "url": self.url,
            "status": self.status,
            "body_excerpt": self.body_excerpt,
            "elapsed_s": round(self.elapsed_s, 6),
            "error": self.error,
        }


@dataclass(frozen=True)
class Reply:
    """What one engine call produced: its record, the body read (bounded), and whether it timed out."""

    call: EngineCall
    body: bytes = b""
    timed_out: bool = False

    @property
    def status(self) -> int | None:
        """The HTTP status, None when no response came."""
        return self.call.status

    def json(self) -> Any:
        """The body as JSON, None when it is empty or not JSON."""
        try:
            return json.loads(self.body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return None


def _excerpt(body: bytes) -> str:
    """A bounded, printable excerpt of an engine's response (kept as evidence)."""
    text = body[:BODY_EXCERPT_BYTES].decode("utf-8", errors="replace")
    return text + ("…" if len(body) > BODY_EXCERPT_BYTES else "")


async def _read_bounded(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The whole body up to `limit` bytes: `read(n)` alone returns only what has arrived so far."""
    parts: list[bytes] = []
    size = 0
    while size < limit:  # bounded: each turn reads at least one byte, or the body ended
        chunk = await content.read(limit - size)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


async def engine_call(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    timeout_s: float,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
) -> Reply:
    """Make one bounded call to the engine and record it; never raises (except cancellation)."""
    started = time.monotonic()
    recorded = redact_url(url)
    try:
        response = await send_upstream(
            session,
            method,
            url,
            data=body if body is not None else (b"" if method in ("POST", "PUT") else None),
            headers=headers or {},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            allow_redirects=False,
        )
        async with response:
            body = await _read_bounded(response.content, _BODY_READ_LIMIT)
            call = EngineCall(method, recorded, response.status, _excerpt(body), time.monotonic() - started)
            return Reply(call, body)
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        connect = isinstance(exc, aiohttp.ConnectionTimeoutError)
        what = "connect timeout" if connect else f"no answer within {timeout_s:g} s"
        call = EngineCall(method, recorded, None, "", time.monotonic() - started, f"timeout: {what}")
        # A connect timeout is an unreachable engine; a read timeout may be a busy llama.cpp slot.
        return Reply(call, timed_out=not connect)
    except (aiohttp.ClientError, OSError) as exc:
        call = EngineCall(
            method, recorded, None, "", time.monotonic() - started, _call_error(exc, url, recorded)
        )
        return Reply(call)


def _call_error(exc: BaseException, url: str, recorded: str) -> str:
    """Why a call got no answer: a connect failure names the address and the OS error."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        dns = isinstance(exc, aiohttp.ClientConnectorDNSError)
        return f"cannot connect to the engine at {host_port(exc.host, exc.port)}: {os_reason(exc.os_error, dns=dns)}"
    return f"{type(exc).__name__}: {_redacted_error(exc, url, recorded)}"


def _redacted_error(exc: BaseException, url: str, recorded: str) -> str:
    """An exception's text with the raw URL (and its credentials) replaced by the redacted one."""
    return str(exc).replace(url, recorded)


def bearer(api_key: str | None) -> dict[str, str] | None:
    """The `Authorization` header that carries the engine's own key, None without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else None
