"""HTTP helpers shared by the simulator's routes: JSON bodies, errors, SSE events."""

from __future__ import annotations

import json
from typing import Any

import orjson
from aiohttp import web

__all__ = ["DONE", "error_response", "json_body", "read_json", "send_event", "sse_response"]

DONE = b"data: [DONE]\n\n"
_JSON = "application/json"


def json_body(data: Any, status: int = 200) -> web.Response:
    """A JSON response encoded with orjson."""
    return web.Response(body=orjson.dumps(data), status=status, content_type=_JSON)


def error_response(
    status: int, message: str, err_type: str = "BadRequestError", param: str | None = None
) -> web.Response:
    """An OpenAI-style error answer; `param` names the request field at fault (vLLM's VLLMValidationError)."""
    return json_body(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}}, status
    )


async def read_json(request: web.Request) -> dict[str, Any] | web.Response:
    """The request's JSON object, or a 400 answer.

    Read with Python's json, as vLLM's and SGLang's servers (FastAPI, Starlette's
    `Request.json()`) read theirs: escaped member names decoded, the last of two equal names
    kept, NaN, Infinity, 1e400 and lone surrogates taken. orjson refuses the last four, and
    the sidecar's reading must be tested against the engine's, not against its own (issue 45).
    """
    try:
        body = json.loads(await request.read())
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return error_response(400, "request body is not valid JSON")
    if not isinstance(body, dict):
        return error_response(400, "request body must be a JSON object")
    return body


async def sse_response(request: web.Request) -> web.StreamResponse:
    """Start an SSE response (headers sent at once)."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, data: dict[str, Any]) -> None:
    """Write one SSE event `data: {json}` + blank line as its own chunk.

    aiohttp's `write` hands the bytes to the transport at once (TCP_NODELAY is on) and
    waits for the socket to drain when its buffer fills, so each token leaves now.
    """
    await resp.write(b"data: " + orjson.dumps(data) + b"\n\n")
