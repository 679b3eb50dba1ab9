"""Each simulated engine's per-request isolation field, read as the engine reads it.

vLLM: `cache_salt` (a non-empty string of at most 128 characters without '@', '/', '\\' or NUL,
`validate_cache_salt`) salts the first block's hash. SGLang: `cache_salt` and `extra_key`, joined,
key the radix cache. llama.cpp and mindnano: `cache_prompt` (their dialects read it). With
`--ignore-isolation` the engine caches every request anyway: an engine that ignores isolation.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from proxy.sim.dialect import SimDialect
from proxy.sim.engine import Sequence
from proxy.sim.wire import error_response

__all__ = ["read_isolation"]

_VLLM_MAX_SALT = 128
_VLLM_FORBIDDEN = frozenset("@/\\\x00")


def _vllm_salt(body: dict[str, Any]) -> str | web.Response | None:
    """vLLM's `cache_salt`, checked by its rules."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        return error_response(400, "Parameter 'cache_salt' must be a non-empty string if provided.")
    if len(salt) > _VLLM_MAX_SALT or any(char in _VLLM_FORBIDDEN for char in salt):
        return error_response(
            400,
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.",
        )
    return salt


def _sglang_salt(body: dict[str, Any]) -> str | web.Response | None:
    """SGLang's `cache_salt` then `extra_key`, joined (`_compute_extra_key`); each a string."""
    parts = []
    for key in ("cache_salt", "extra_key"):
        value = body.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            return error_response(400, f"Value of {key} must be a string, but got {type(value).__name__}")
        parts.append(value)
    return "".join(parts) or None


def read_isolation(dialect: SimDialect, body: dict[str, Any], seq: Sequence) -> web.Response | None:
    """Set the sequence's salt from the request (cache_prompt is the dialect's own); a 400 when bad.

    SGLang's /generate reads the same two fields as its OpenAI routes.
    """
    salt: str | web.Response | None = None
    if dialect.name == "vllm":
        salt = _vllm_salt(body)
    elif dialect.name == "sglang":
        salt = _sglang_salt(body)
    if isinstance(salt, web.Response):
        return salt
    if dialect.config.ignore_isolation:
        seq.cache_salt, seq.cache_prompt = None, True
    else:
        seq.cache_salt = salt
    return None
