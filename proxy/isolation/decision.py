"""Whether one request is isolated: its header, its case, or the sidecar's config says so."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.vocabulary import IsolationMode

__all__ = ["ISOLATION_HEADER", "BadIsolationHeader", "header_asks"]

# The sidecar's own request header (benchmark tools add headers unchanged: aiperf -H,
# `vllm bench serve --header`); never forwarded to the engine.
ISOLATION_HEADER = "X-Cachewitness-Isolation"


class BadIsolationHeader(Exception):
    """An isolation header with a value the sidecar does not know: the request must not run as if unasked."""


def header_asks(headers: Mapping[str, str]) -> bool:
    """Whether the request's header asks for isolation; raises BadIsolationHeader for another value."""
    value = headers.get(ISOLATION_HEADER)
    if value is None:
        return False
    word = value.strip().lower()
    if word == IsolationMode.REQUEST:
        return True
    if word == IsolationMode.NONE:
        return False
    raise BadIsolationHeader(f'{ISOLATION_HEADER} must be "request" or "none", not {value[:40]!r}')
