"""OpenAI-style JSON errors produced by the sidecar itself."""

from __future__ import annotations

import orjson
from aiohttp import web

__all__ = ["error_response"]


def error_response(
    status: int,
    message: str,
    *,
    type_: str,
    code: str | int | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    hint: str | None = None,
) -> web.Response:
    """`{"error": {"message", "type", "code", "param"}}` with the given status (and `hint`: what to do)."""
    error: dict[str, object] = {"message": message, "type": type_, "code": code, "param": param}
    if hint is not None:
        error["hint"] = hint
    body = {"error": error}
    return web.Response(
        status=status,
        body=orjson.dumps(body),
        content_type="application/json",
        headers=headers,
    )
