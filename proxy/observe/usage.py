"""Token counts out of engine answers: a decoded object, a JSON body, or a fragment of one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.observe.jsonscan import Buffer, find_members, skip_ws, value_end
from proxy.observe.tiers import tiers_from

__all__ = [
    "NO_USAGE",
    "Usage",
    "first_id",
    "usage_from_fragment",
    "usage_from_json",
    "usage_from_object",
]

DETAILS_SOURCE = "usage.prompt_tokens_details.cached_tokens"
# The members that carry counts: OpenAI `usage` (also nested under `response` and
# `message`), llama.cpp `timings`, SGLang /generate `meta_info`, mindnano's own block, SGLang's
# per-tier `sglext`.
USAGE_KEYS = (b'"usage"', b'"timings"', b'"meta_info"', b'"mindnano_metrics"', b'"sglext"')


@dataclass(frozen=True)
class Usage:
    """Token counts an engine reported; None wherever it did not say (never 0 for unknown)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_tokens_source: str | None = None
    # Cached tokens per tier where the engine names them (proxy/observe/tiers.py); None otherwise.
    cached_by_tier: dict[str, int] | None = None

    def merged(self, newer: Usage) -> Usage:
        """Field-wise update: what `newer` knows wins, what it doesn't keeps the old value."""
        cached, source = self.cached_tokens, self.cached_tokens_source
        if newer.cached_tokens is not None:
            cached, source = newer.cached_tokens, newer.cached_tokens_source
        return Usage(
            prompt_tokens=newer.prompt_tokens if newer.prompt_tokens is not None else self.prompt_tokens,
            completion_tokens=(
                newer.completion_tokens if newer.completion_tokens is not None else self.completion_tokens
            ),
            cached_tokens=cached,
            cached_tokens_source=source,
            cached_by_tier=newer.cached_by_tier if newer.cached_by_tier is not None else self.cached_by_tier,
        )


NO_USAGE = Usage()


def _int(value: Any) -> int | None:
    """A token count: a non-negative int, not a bool."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _dig(obj: Any, *keys: str) -> Any:
    """obj[k1][k2]... or None when any step is missing or not an object."""
    for key in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _usage_block(obj: dict[str, Any]) -> dict[str, Any]:
    """The `usage` object: top level (OpenAI), under `response` (Responses API
    `response.completed`) or under `message` (Messages API `message_start`)."""
    for candidate in (obj.get("usage"), _dig(obj, "response", "usage"), _dig(obj, "message", "usage")):
        if isinstance(candidate, dict):
            return candidate
    return {}


def usage_from_object(obj: Any) -> Usage:
    """Token counts from one decoded response body or stream event."""
    if not isinstance(obj, dict):
        return NO_USAGE
    usage = obj.get("usage")
    # The shape nearly every answer has (OpenAI usage with prompt_tokens_details): read it
    # without walking the other engines' fields — this runs for every observed request.
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached = details.get("cached_tokens")
            prompt = usage.get("prompt_tokens")
            completion = usage.get("completion_tokens")
            # `_int` written out (`type(x) is int` is never a bool); anything else takes the way below.
            if (
                type(cached) is int
                and type(prompt) is int
                and type(completion) is int
                and cached >= 0
                and prompt >= 0
                and completion >= 0
            ):
                # Per-tier counts ride beside cached_tokens or in SGLang's `sglext`: looked for only then.
                tiers = tiers_from(obj, details) if len(details) > 1 or "sglext" in obj else None
                return Usage(prompt, completion, cached, DETAILS_SOURCE, tiers)
    usage = _usage_block(obj)
    # The order of docs/evidence.md, then llama.cpp's /v1/messages field.
    # llama.cpp's `tokens_cached` is the slot's whole length, not a hit count: never read.
    cached_fields: tuple[tuple[str, Any], ...] = (
        (DETAILS_SOURCE, _dig(usage, "prompt_tokens_details", "cached_tokens")),
        ("usage.input_tokens_details.cached_tokens", _dig(usage, "input_tokens_details", "cached_tokens")),
        ("timings.cache_n", _dig(obj, "timings", "cache_n")),
        ("meta_info.cached_tokens", _dig(obj, "meta_info", "cached_tokens")),
        ("mindnano_metrics.cached_tokens", _dig(obj, "mindnano_metrics", "cached_tokens")),
        ("usage.cache_read_input_tokens", usage.get("cache_read_input_tokens")),
    )
    cached, source = None, None
    for name, value in cached_fields:
        if _int(value) is not None:
            cached, source = _int(value), name
            break
    return Usage(
        prompt_tokens=_prompt_tokens(obj, usage),
        completion_tokens=_first_int(
            usage.get("completion_tokens"),
            usage.get("output_tokens"),
            _dig(obj, "meta_info", "completion_tokens"),
            _dig(obj, "timings", "predicted_n"),
        ),
        cached_tokens=cached,
        cached_tokens_source=source,
        cached_by_tier=tiers_from(obj, usage.get("prompt_tokens_details")),
    )


def _prompt_tokens(obj: dict[str, Any], usage: dict[str, Any]) -> int | None:
    """The whole prompt's length, cached part included.

    Sources in order: `usage.prompt_tokens` (OpenAI chat/completions, all engines);
    `usage.input_tokens` (Responses API; Messages API adds
    `cache_read_input_tokens` + `cache_creation_input_tokens`, because Anthropic's
    `input_tokens` excludes them — llama.cpp sends `n_prompt - n_cache` there);
    `meta_info.prompt_tokens` (SGLang /generate); `timings.prompt_n + cache_n`
    (llama.cpp: `prompt_n` counts only the tokens it evaluated).
    """
    prompt = _int(usage.get("prompt_tokens"))
    if prompt is not None:
        return prompt
    prompt = _int(usage.get("input_tokens"))
    if prompt is not None:
        extra = (_int(usage.get("cache_read_input_tokens")) or 0) + (
            _int(usage.get("cache_creation_input_tokens")) or 0
        )
        return prompt + extra
    prompt = _int(_dig(obj, "meta_info", "prompt_tokens"))
    if prompt is not None:
        return prompt
    evaluated, cached = _int(_dig(obj, "timings", "prompt_n")), _int(_dig(obj, "timings", "cache_n"))
    if evaluated is not None and cached is not None:
        return evaluated + cached
    return None


def _first_int(*values: Any) -> int | None:
    """The first value that is a token count."""
    for value in values:
        if _int(value) is not None:
            return _int(value)
    return None


def usage_from_json(body: Buffer) -> Usage:
    """Token counts from a complete JSON document (a body, or one event's data); never raises."""
    try:
        return usage_from_object(orjson.loads(body))
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return NO_USAGE


def usage_from_fragment(data: Buffer, start: int, end: int) -> Usage | None:
    """Token counts from a piece of a JSON document too large to keep whole (its tail).

    Each counting member (`usage`, `timings`, `meta_info`, `mindnano_metrics`) that lies
    whole in data[start:end] is decoded on its own, the last of each name winning; None
    when there is none. Where `usage` sat (top level, under `response` or `message`) does
    not change what it says.
    """
    found: dict[str, Any] = {}
    for key in USAGE_KEYS:
        objects = [m for m in find_members(data, key, start, end) if m.is_object]
        if not objects:
            continue
        try:
            found[key[1:-1].decode()] = orjson.loads(data[objects[-1].value_start : objects[-1].value_end])
        except (orjson.JSONDecodeError, TypeError, ValueError):
            continue
    return usage_from_object(found) if found else None


def first_id(data: Buffer, start: int, end: int) -> str | None:
    """The first `"id": "<string>"` member in data[start:end]: the engine's own id for an answer.

    OpenAI-shaped answers and chunks begin with it; Responses and Messages streams carry it
    first in their opening event's `response` / `message`. Bounded to 128 characters.
    """
    pos = data.find(b'"id"', start, end)
    while pos != -1:
        colon = skip_ws(data, pos + 4, end)
        if (pos == start or data[pos - 1] != 0x5C) and colon < end and data[colon] == 0x3A:
            value = skip_ws(data, colon + 1, end)
            close = value_end(data, value, end) if value < end and data[value] == 0x22 else -1
            if close != -1:
                try:
                    text = orjson.loads(data[value:close])
                except (orjson.JSONDecodeError, TypeError, ValueError):
                    return None
                return text[:128] if isinstance(text, str) else None
        pos = data.find(b'"id"', pos + 4, end)
    return None
