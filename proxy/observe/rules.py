"""Each engine's stream facts under an injected `include_usage`, as data: what is taken out again.

One row per dialect (and per version where the engine changed): a new engine version is
one entry here and one test. The scanner (`stream.py`) applies the row; it knows no engine.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Protocol

from proxy.observe.jsonscan import Buffer, find_members, skip_ws, trailing_members
from proxy.vocabulary import EngineKind

__all__ = [
    "INJECTION_REPROBE_S",
    "STREAM_RULES",
    "EngineIdentity",
    "InjectionRefusals",
    "RuleEntry",
    "StreamRules",
    "has_finish",
    "is_usage_only",
    "moved_members",
    "rules_for",
    "version_tuple",
    "with_members",
]


class EngineIdentity(Protocol):
    """What the rules read of an engine: its kind and version (`proxy.engines.base.EngineInfo` has both).

    A protocol, not the engines' class: observe and engines stand in one layer and import
    neither the other.
    """

    @property
    def kind(self) -> str:
        """The engine kind (an `EngineKind` value)."""

    @property
    def version(self) -> str | None:
        """The version the engine reports, None when it does not say."""


_FINISH_KEY = b'"finish_reason"'


@dataclass(frozen=True)
class StreamRules:
    """What `stream_options.include_usage` makes one engine add to a stream.

    Always added, always removed: the usage-only chunk (`"choices": []`) and a usage object
    on a content chunk (llama.cpp /v1/completions puts it on the finish chunk).
    """

    # Whether the sidecar injects include_usage at all.
    inject: bool = True
    # Whether the engine writes `"usage": null` on every other chunk BECAUSE include_usage
    # is on (OpenAI's contract). An engine that writes it whether asked or not keeps it.
    null_usage_added: bool = True
    # Members the engine puts on a stream's LAST event, which is the usage chunk with the
    # injection and the finish chunk without: they move back onto the finish chunk.
    # None: any member that follows `usage` on the usage chunk and the finish chunk lacks.
    last_event_members: frozenset[bytes] | None = None


@dataclass(frozen=True)
class RuleEntry:
    """Rules for one engine kind from `since` (a version prefix, compared numerically) on."""

    kind: str
    since: tuple[int, ...]
    rules: StreamRules


# Checked against the engines' own sources (see shared ENGINES.md) and the real servers
# in tests/real. Later entries of a kind win for versions at or after their `since`.
STREAM_RULES: tuple[RuleEntry, ...] = (
    # vLLM 0.32 (seen): no `"usage": null` members; `system_fingerprint` on the last chunk.
    RuleEntry(
        EngineKind.VLLM,
        (),
        StreamRules(null_usage_added=False, last_event_members=frozenset({b'"system_fingerprint"'})),
    ),
    # SGLang's pydantic-era chunks (`model_dump_json()`) carry `"usage": null` whether asked
    # or not; its msgspec encoder (sse_utils.StreamChunk, omit_defaults) never writes it.
    # Either way the null is not the injection's: never strip it.
    RuleEntry(EngineKind.SGLANG, (), StreamRules(null_usage_added=False, last_event_members=frozenset())),
    # llama.cpp: never injected — the finish chunk carries `timings.cache_n`, and its
    # /v1/completions streams may carry usage unasked. `timings` rides on the last event.
    RuleEntry(
        EngineKind.LLAMACPP,
        (),
        StreamRules(inject=False, null_usage_added=False, last_event_members=frozenset({b'"timings"'})),
    ),
    # mindnano: OpenAI's nulls; `mindnano_metrics` is on the finish chunk already.
    RuleEntry(EngineKind.MINDNANO, (), StreamRules(null_usage_added=True, last_event_members=frozenset())),
)
# Any other OpenAI-compatible server: OpenAI's contract, and whatever trails usage moves back.
DEFAULT_RULES = StreamRules()


def version_tuple(text: str | None) -> tuple[int, ...]:
    """The leading numeric parts of a version string: '0.5.10rc1' -> (0, 5, 10)."""
    match = re.match(r"\d+(?:\.\d+)*", text or "")
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def rules_for(info: EngineIdentity | None, table: tuple[RuleEntry, ...] = STREAM_RULES) -> StreamRules:
    """The stream rules of the engine the sidecar fronts (the default for one not yet known)."""
    if info is None:
        return DEFAULT_RULES
    key = (info.kind, info.version, id(table))
    known = _CHOSEN.get(key)
    if known is not None:
        return known[1]
    rules = _choose(info.kind, info.version, table)
    if len(_CHOSEN) >= _CHOSEN_MAX:
        _CHOSEN.clear()
    _CHOSEN[key] = (table, rules)
    return rules


# Asked per request, and parsing the version with a regex each time was a tenth of a request's
# own work (bench/README.md, issue 34): the choice is kept per engine identity and table. A
# redetected engine (another version after a restart) is another key. The table is keyed by
# its id, not hashed (hashing its entries cost as much as the parse); the entry holds the
# table, so that id names no other table while the entry lives.
_CHOSEN: dict[tuple[str, str | None, int], tuple[tuple[RuleEntry, ...], StreamRules]] = {}
_CHOSEN_MAX = 64


def _choose(kind: str, version_text: str | None, table: tuple[RuleEntry, ...]) -> StreamRules:
    """The last entry of `table` for `kind` whose `since` the version reaches."""
    version = version_tuple(version_text)
    chosen = DEFAULT_RULES
    for entry in table:
        if entry.kind == kind and (not entry.since or (version and version >= entry.since)):
            chosen = entry.rules
    return chosen


# -- the byte-level facts the rules are applied with ------------------------------------
def has_finish(data: Buffer, start: int, end: int) -> bool:
    """Whether data[start:end] sets a `finish_reason` (to a string: null is not set)."""
    pos = data.find(_FINISH_KEY, start, end)
    while pos != -1:
        colon = skip_ws(data, pos + len(_FINISH_KEY), end)
        if colon < end and data[colon] == 0x3A:
            value = skip_ws(data, colon + 1, end)
            if value < end and data[value] == 0x22:
                return True
        pos = data.find(_FINISH_KEY, pos + 1, end)
    return False


def is_usage_only(data: Buffer, start: int, end: int) -> bool:
    """The include_usage chunk: `"choices": []` (OpenAI's empty choices on the usage chunk)."""
    pos = data.find(b'"choices"', start, end)
    if pos == -1:
        return False
    colon = skip_ws(data, pos + 9, end)
    if colon >= end or data[colon] != 0x3A:
        return False
    bracket = skip_ws(data, colon + 1, end)
    if bracket >= end or data[bracket] != 0x5B:
        return False
    close = skip_ws(data, bracket + 1, end)
    return close < end and data[close] == 0x5D


def moved_members(usage_payload: bytes, finish_event: bytes, names: frozenset[bytes] | None) -> bytes:
    """Raw `,"k":v` members after `usage` on the usage chunk that belong on the finish chunk."""
    objects = [m for m in find_members(usage_payload, b'"usage"', 0, len(usage_payload)) if m.is_object]
    close = usage_payload.rfind(b"}")
    if not objects or close == -1:
        return b""
    return b"".join(
        raw
        for key, raw in trailing_members(usage_payload, objects[-1].value_end, close)
        if (names is None or key in names)
        and key + b":" not in finish_event
        and key + b" :" not in finish_event
    )


def with_members(event: bytes, members: bytes) -> bytes:
    """The event with raw `,"k":v` members added before its JSON's closing brace."""
    close = event.rfind(b"}")
    if close == -1 or not members:
        return event
    return event[:close] + members + event[close:]


# How long a refusal is remembered (config `inject_usage_reprobe_seconds`): the engine is then
# tried again, so an engine fixed or upgraded in place is noticed, and nothing any request
# does switches the injection off for longer.
INJECTION_REPROBE_S = 600.0


class InjectionRefusals:
    """Engines (kind and version) that refused an injected `stream_options`, each for `reprobe_s`.

    A refusal is remembered only from the sidecar's own probe (proxy/forward/injection_probe.py),
    never from a client's request: a body the engine reads otherwise than the sidecar could
    otherwise switch the injection off for everyone (issue 45). Each such engine costs one
    probe per `reprobe_s`, not one retried request per stream.
    """

    def __init__(self, reprobe_s: float = INJECTION_REPROBE_S) -> None:
        """None known yet."""
        self.reprobe_s = reprobe_s
        # Engine key -> time.monotonic() of its last confirmed refusal.
        self._refused: dict[tuple[str, str | None], float] = {}

    def refused(self, info: EngineIdentity | None) -> bool:
        """Whether this engine refused the injection less than `reprobe_s` ago."""
        if not self._refused:  # nearly always: asked once per observed request
            return False
        key = _key(info)
        at = self._refused.get(key)
        if at is None:
            return False
        if time.monotonic() - at < self.reprobe_s:
            return True
        del self._refused[key]  # stale: the next stream probes the engine again
        return False

    def remember(self, info: EngineIdentity | None) -> None:
        """This engine refused it, and the same request without it succeeded."""
        self._refused[_key(info)] = time.monotonic()


def _key(info: EngineIdentity | None) -> tuple[str, str | None]:
    """An engine's identity; one not detected (no engine state) is one key of its own."""
    return (info.kind, info.version) if info is not None else ("", None)
