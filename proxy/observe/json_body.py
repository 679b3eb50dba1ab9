"""A whole (non-stream) JSON response read as it passes, in bounded memory."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.observe.usage import (
    NO_USAGE,
    Usage,
    first_id,
    usage_from_fragment,
    usage_from_json,
    usage_from_object,
)

__all__ = ["KEEP_BYTES", "JsonBody"]

# What is kept of each end of a response. Usage sits at the end of an OpenAI-shaped response
# (after `choices`; llama.cpp's `timings` and SGLang's `meta_info` too), the engine's id at
# the start: a response of any size costs at most 3 × this.
KEEP_BYTES = 64 * 1024
# How an OpenAI-shaped answer (vLLM's, SGLang's) begins: its id, compact, a string.
_OPENS_WITH_ID = b'{"id":"'


class JsonBody:
    """Keeps the head and a bounded tail of a JSON response; reads usage and the engine's id at the end.

    A response that fits is decoded whole, exactly; a larger one is read from its tail, each
    counting member decoded on its own (`usage_from_fragment`).
    """

    def __init__(self) -> None:
        """Nothing seen yet."""
        self._head = bytearray()
        self._tail = bytearray()
        self._size = 0

    def feed(self, chunk: bytes) -> None:
        """Take one chunk of the response (the caller writes it to the client unchanged)."""
        self._size += len(chunk)
        room = KEEP_BYTES - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self._tail += chunk
            if len(self._tail) > 2 * KEEP_BYTES:
                del self._tail[:-KEEP_BYTES]

    @property
    def kept_bytes(self) -> int:
        """Bytes held now (for the memory test)."""
        return len(self._head) + len(self._tail)

    def usage(self) -> Usage:
        """Token counts the response reported."""
        if self._size == len(self._head) + len(self._tail):
            return usage_from_json(bytes(self._head + self._tail))
        return usage_from_fragment(self._tail, 0, len(self._tail)) or NO_USAGE

    def engine_id(self) -> str | None:
        """The engine's own id for this response (its first `id` member), if it has one."""
        return first_id(self._head, 0, len(self._head))

    def read(self) -> tuple[Usage, str | None]:
        """`usage()` and `engine_id()` at once: a response that fits is decoded once for both.

        An OpenAI-shaped answer opens with its id (`{"id":"chatcmpl-…",`): when that is the
        body's only `"id"`, it is the first one, and the decoded body's `id` is what
        `engine_id()` would read; any other body is searched as `engine_id()` searches it
        (bench/calls.py, issue 34: five calls fewer per request).
        """
        if self._size != len(self._head) + len(self._tail):
            return self.usage(), self.engine_id()
        whole = bytes(self._head + self._tail)
        try:
            decoded: Any = orjson.loads(whole)
        except (orjson.JSONDecodeError, TypeError, ValueError):
            return NO_USAGE, self.engine_id()
        usage = usage_from_object(decoded)
        if whole.startswith(_OPENS_WITH_ID) and whole.count(b'"id"') == 1 and isinstance(decoded, dict):
            found = decoded.get("id")
            return usage, found[:128] if isinstance(found, str) else None
        return usage, self.engine_id()
