"""Engine route facts: which of an engine's paths are control routes, and its own reset route.

Paths here are canonical (lowercase, no empty or dot segments, no trailing slash): the
sidecar matches them against a request path normalised the same way (proxy/admin/policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ANY_METHOD", "NativeReset", "RouteRule", "control", "control_prefix"]

ANY_METHOD: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RouteRule:
    """A path (or, with `prefix`, every path starting with it) and the methods it covers (empty: any)."""

    path: str
    methods: frozenset[str] = ANY_METHOD
    prefix: bool = False

    def matches(self, method: str, path: str) -> bool:
        """True when `method` and the normalised `path` fall under this rule."""
        if self.methods and method.upper() not in self.methods:
            return False
        # A plain string prefix: "/update_weights" also covers "/update_weights_from_disk",
        # and "/slots" covers "/slots/0". Matching more than needed only asks for auth.
        return path.startswith(self.path) if self.prefix else path == self.path


def control(path: str, *methods: str) -> RouteRule:
    """A control route at exactly `path` (any method unless some are named)."""
    return RouteRule(path, frozenset(m.upper() for m in methods))


def control_prefix(path: str, *methods: str) -> RouteRule:
    """Every path that starts with `path`."""
    return RouteRule(path, frozenset(m.upper() for m in methods), prefix=True)


@dataclass(frozen=True)
class NativeReset:
    """An engine's own prefix-cache reset route, which the sidecar intercepts.

    `force_param` (a boolean query parameter) maps to the reset's `force`; `wait_param`
    (seconds) to its `retry_seconds`. `content_type` is what the engine answers with;
    `refusal_status` / `refusal_body` are the engine's own "not reset" answer, given when
    the sidecar's verdict is a failure that the engine's last answer does not say.
    """

    rule: RouteRule
    content_type: str
    refusal_status: int
    refusal_body: bytes
    force_param: str | None = None
    wait_param: str | None = None
