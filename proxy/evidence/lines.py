"""A record as one evidence line: JSON, at most MAX_LINE_BYTES once chained, long strings cut to fit."""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["CHAIN_SUFFIX_MAX", "MAX_LINE_BYTES", "encode_record"]

MAX_LINE_BYTES = 64 * 1024
# A string longer than this is cut when a record would not fit in one line.
_TRUNCATED_STRING_CHARS = 1024


def _truncate_strings(value: Any) -> Any:
    """A copy of value with every long string cut (bounded excerpts such as `calls[].body`)."""
    if isinstance(value, str) and len(value) > _TRUNCATED_STRING_CHARS:
        return value[:_TRUNCATED_STRING_CHARS] + "…[truncated]"
    if isinstance(value, dict):
        return {k: _truncate_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_truncate_strings(v) for v in value]
    return value


# The most a line grows by when chained: `,"dropped_before":N,"seq":N,"prev":"<64 hex>"`.
CHAIN_SUFFIX_MAX = 128
# An encoded record leaves room for the chain fields the writer's thread adds (proxy/evidence/chain.py).
_RECORD_BYTES = MAX_LINE_BYTES - CHAIN_SUFFIX_MAX


def encode_record(record: dict[str, Any]) -> bytes | None:
    """One JSONL line (ending "\\n") that fits MAX_LINE_BYTES once chained, or None if it cannot.

    A record over the limit keeps its shape with long strings cut and gets
    `"truncated": true`; one still too big after that is refused.
    """
    line = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS)
    if len(line) > _RECORD_BYTES:
        shrunk = _truncate_strings(record)
        shrunk["truncated"] = True
        line = orjson.dumps(shrunk, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS)
        if len(line) > _RECORD_BYTES:
            return None
    # orjson's bytes keep their over-allocated buffer (a 500-byte line holds ~8 KB: ijl/orjson#483);
    # a line waiting for a full disk must cost its length, so it is copied to its exact size.
    return bytes(memoryview(line))
