"""Which requests are observed, and the request body with `stream_options.include_usage` added."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

__all__ = [
    "INJECTABLE_PATHS",
    "OBSERVED_PATHS",
    "PreparedRequest",
    "is_observed",
    "names_stream_options",
    "prepare_request",
]

OBSERVED_PATHS: frozenset[str] = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/completion",
        "/generate",
    }
)

# Only the OpenAI chat/completions routes know `stream_options`. SGLang's native
# /generate and llama.cpp's /completion have no such field; /v1/responses
# (`response.completed`) and /v1/messages (`message_start`/`message_delta`)
# streams already carry usage in their own events, so nothing is injected there.
INJECTABLE_PATHS: frozenset[str] = frozenset({"/v1/chat/completions", "/v1/completions"})


def is_observed(method: str, path: str) -> bool:
    """Whether a forwarded request is an inference request that gets an observation."""
    return method == "POST" and path in OBSERVED_PATHS


@dataclass(frozen=True)
class PreparedRequest:
    """The request body to send upstream and what was learnt reading it."""

    body: bytes
    stream: bool
    model: str | None
    usage_injected: bool


def prepare_request(body: bytes, *, inject_usage: bool, path: str | None = None) -> PreparedRequest:
    """Read `stream`/`model` and add `stream_options.include_usage` when allowed; never raises.

    `path`, when given, limits injection to `INJECTABLE_PATHS`; None means the
    caller has already decided the route takes `stream_options`.
    """
    try:
        payload = orjson.loads(body)
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return PreparedRequest(body=body, stream=False, model=None, usage_injected=False)
    if not isinstance(payload, dict):
        return PreparedRequest(body=body, stream=False, model=None, usage_injected=False)
    stream = payload.get("stream") is True
    model = payload.get("model") if isinstance(payload.get("model"), str) else None
    unchanged = PreparedRequest(body=body, stream=stream, model=model, usage_injected=False)
    # vLLM answers 400 to stream_options when stream is false: only touch streams.
    if not (inject_usage and stream) or (path is not None and path not in INJECTABLE_PATHS):
        return unchanged
    options = payload.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        return unchanged  # malformed: let the engine answer the client's own mistake
    if options.get("include_usage") is True:
        return unchanged  # the client asked for usage itself and must get it
    payload["stream_options"] = {**options, "include_usage": True}
    try:
        rewritten = orjson.dumps(payload)
    except (orjson.JSONEncodeError, TypeError):
        return unchanged
    return PreparedRequest(body=rewritten, stream=stream, model=model, usage_injected=True)


def names_stream_options(error_body: bytes) -> bool:
    """Whether an engine's error answer is about `stream_options` (so about our injection)."""
    return b"stream_options" in error_body
