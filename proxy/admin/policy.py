"""The route policy: which engine paths are control routes, intercepted resets, or plain traffic.

Every request the sidecar does not serve itself is classified here on its *normalised*
path, so that `//x`, `/./x`, `/x/`, `/X`, `/%78` and `/%2578` are all `/x`. Matching more
spellings than the engine accepts only asks a caller for the admin token; matching fewer
would let a stranger reach a control route. A path whose meaning engines could disagree on
is not classified at all: it is refused (`decoded_path`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import unquote

from proxy.config import Settings
from proxy.engines import dynamo, llamacpp, mindnano, sglang, trtllm, vllm
from proxy.engines.base import Dialect
from proxy.engines.routes import NativeReset, RouteRule, control, control_prefix
from proxy.vocabulary import EngineKind

__all__ = [
    "ALL_CONTROL_ROUTES",
    "DECODE_PASSES",
    "RouteClass",
    "RouteDecision",
    "RoutePolicy",
    "decoded_path",
    "normalise_path",
    "unfolded_path",
]

# For an engine whose kind is not known (not detected yet, generic, none): every known
# engine's control routes, so that nothing opens while the kind is unsure.
ALL_CONTROL_ROUTES: tuple[RouteRule, ...] = (
    *vllm.CONTROL_ROUTES,
    *sglang.CONTROL_ROUTES,
    *llamacpp.CONTROL_ROUTES,
    *mindnano.CONTROL_ROUTES,
    *trtllm.CONTROL_ROUTES,
    *dynamo.CONTROL_ROUTES,
)
# Distinct plain-traffic paths remembered; past it, decisions are made afresh (a client
# spraying random paths only loses the shortcut).
_MEMO_SIZE = 1024
_KNOWN_KINDS = frozenset(
    {
        EngineKind.VLLM,
        EngineKind.SGLANG,
        EngineKind.LLAMACPP,
        EngineKind.MINDNANO,
        EngineKind.TRTLLM,
        EngineKind.DYNAMO,
    }
)
# Percent-decoding passes before a path is judged: the engine's own, and one more for a client
# or proxy that encoded twice. Decoding until nothing changed cost 44 ms for an 8 KB `%2525...`
# path (quadratic); what still holds `%` after two passes is refused instead (issue 27).
DECODE_PASSES = 2
# `%uXXXX` in any case: cpp-httplib (llama-server's HTTP library) decodes `%u0073` to `s` and
# drops `%uD800`..`%uDFFF` altogether; Python's unquote and Starlette leave both as they are.
_UNICODE_ESCAPE = re.compile(r"%[uU]")
# Control characters: C-string routers stop at NUL, log lines break at CR/LF.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class RouteClass(StrEnum):
    """What the sidecar does with a request it does not serve itself."""

    FORWARDED = "forwarded"  # to the engine untouched, no admin auth
    CONTROL = "control"  # admin auth, then forwarded with the engine's key instead of the admin token
    NATIVE_RESET = "native_reset"  # admin auth, then the sidecar's reset, answered in the engine's shape
    SLOT_ERASE = "slot_erase"  # llama.cpp: admin auth, then forwarded and recorded
    INVALID_TARGET = "invalid_target"  # engines could read the path differently: 400, not forwarded


@dataclass(frozen=True)
class RouteDecision:
    """How one request is handled, and the normalised path it was judged on."""

    route: RouteClass
    path: str
    native: NativeReset | None = None


def decoded_path(raw_path: str) -> str | None:
    """`raw_path` without its query, percent-decoded at most twice; None when engines could disagree on it.

    None for: a `%` still there after two passes (an engine decodes once; the second pass
    covers a path encoded twice), a `%u`/`%U` escape at any stage, decoded bytes that are
    not UTF-8 (Python's decoders replace them, cpp-httplib keeps them as they are) and
    control characters. Linear in the path's length.
    """
    path = raw_path.split("?", 1)[0].split("#", 1)[0]
    if "%" not in path:
        return path  # what the engine sees as well (the request line has no control characters)
    for _ in range(DECODE_PASSES):
        if _UNICODE_ESCAPE.search(path):
            return None
        try:
            path = unquote(path, errors="strict")
        except UnicodeDecodeError:
            return None
        if "%" not in path:
            break
    else:
        return None
    return None if _CONTROL.search(path) else path


def unfolded_path(raw_path: str) -> str | None:
    """`raw_path` decoded as `normalise_path` does, but with its `.` and `..` segments kept (None: refuse it).

    A prefix rule is matched against this form too: an engine that does not fold dot segments
    routes `/dumper/.` under `/dumper/`, which folded reads `/dumper` (issue 45).
    """
    path = decoded_path(raw_path)
    if path is None:
        return None
    return "/" + "/".join(segment for segment in path.replace("\\", "/").split("/") if segment).lower()


def normalise_path(raw_path: str) -> str | None:
    """The path an engine could route `raw_path` to, in the form the rules are written in; None: refuse it.

    Percent-decoded (`decoded_path`: `%2F` too, at most twice), backslashes as slashes,
    empty and `.` segments dropped, `..` applied, lowercased, no trailing slash.
    """
    path = decoded_path(raw_path)
    if path is None:
        return None
    segments: list[str] = []
    for segment in path.replace("\\", "/").split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return ("/" + "/".join(segments)).lower()


def _rule_path(path: str) -> str:
    """A configured path in canonical form (config checks keep `%` out of them)."""
    canonical = normalise_path(path)
    if canonical is None:
        raise ValueError(f"{path!r} is not a plain path")
    return canonical


def _configured_rule(path: str) -> RouteRule:
    """A rule from config: a trailing `*` makes it a prefix ("/debug/*" covers "/debug" too)."""
    if path.endswith("*"):
        return control_prefix(_rule_path(path[:-1]))
    return control(_rule_path(path))


class RoutePolicy:
    """Classifies requests for the engine the sidecar fronts now."""

    def __init__(self, settings: Settings) -> None:
        """Rules from config: `extra_admin_paths`, and a generic engine's `reset_path`."""
        extra = [_configured_rule(path) for path in settings.extra_admin_paths]
        self._extra = tuple(extra)
        self._unknown = ALL_CONTROL_ROUTES + self._extra
        if settings.reset_path:
            self._unknown += (control(_rule_path(settings.reset_path)),)
        # Plain traffic's decisions, per (method, raw path), for the dialect they were made for:
        # a repeated inference path costs 0.3 µs instead of 3.8 µs (timeit, issue 19).
        self._forwarded: dict[tuple[str, str], RouteDecision] = {}
        self._forwarded_for: Dialect | None = None

    def knows(self, dialect: Dialect) -> bool:
        """True when the dialect is a known engine's, with its own route lists."""
        return dialect.kind in _KNOWN_KINDS

    def control_routes(self, dialect: Dialect) -> tuple[RouteRule, ...]:
        """The rules that need admin auth in front of this dialect's engine."""
        if self.knows(dialect):
            return dialect.control_routes + self._extra
        return self._unknown

    def classify(
        self, method: str, raw_path: str, query: Mapping[str, str], dialect: Dialect
    ) -> RouteDecision:
        """The route class of `method raw_path?query` in front of `dialect`'s engine."""
        if dialect is not self._forwarded_for:
            self._forwarded, self._forwarded_for = {}, dialect  # detection changed the engine
        key = (method, raw_path)
        known = self._forwarded.get(key)
        if known is not None:
            return known
        decision = self._decide(method, raw_path, query, dialect)
        if (
            decision.route is RouteClass.FORWARDED
            and len(self._forwarded) < _MEMO_SIZE
            and not _query_decides(method, decision.path, dialect)
        ):
            self._forwarded[key] = decision
        return decision

    def _decide(
        self, method: str, raw_path: str, query: Mapping[str, str], dialect: Dialect
    ) -> RouteDecision:
        path = normalise_path(raw_path)
        if path is None:
            return RouteDecision(RouteClass.INVALID_TARGET, raw_path)
        native = dialect.native_reset
        if native is not None and native.rule.matches(method, path):
            return RouteDecision(RouteClass.NATIVE_RESET, path, native)
        if (
            dialect.kind == EngineKind.LLAMACPP
            and llamacpp.SLOT_ERASE.matches(method, path)
            and _erases(query)
        ):
            return RouteDecision(RouteClass.SLOT_ERASE, path)
        rules = self.control_routes(dialect)
        if any(rule.matches(method, path) for rule in rules):
            return RouteDecision(RouteClass.CONTROL, path)
        unfolded = unfolded_path(raw_path) if "." in raw_path or "%" in raw_path else None
        if unfolded is not None and any(rule.prefix and rule.matches(method, unfolded) for rule in rules):
            return RouteDecision(RouteClass.CONTROL, path)  # matched before its dot segments fold
        return RouteDecision(RouteClass.FORWARDED, path)


def _query_decides(method: str, path: str, dialect: Dialect) -> bool:
    """Whether the query can change this path's class (a llama.cpp slot action: erase or not)."""
    return dialect.kind == EngineKind.LLAMACPP and llamacpp.SLOT_ERASE.matches(method, path)


def _erases(query: Mapping[str, str]) -> bool:
    """True when a llama.cpp slot action asks for an erase (in any spelling)."""
    getall = getattr(query, "getall", None)
    values = getall("action", []) if getall is not None else [query.get("action", "")]
    return any(unquote(str(value)).strip().lower() == "erase" for value in values)
