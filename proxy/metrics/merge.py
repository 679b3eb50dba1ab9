"""The engine's own Prometheus text (fetched by proxy/engines/queries.py), made safe to append to the sidecar's.

Any engine may answer its metrics path with something that is not the exposition format
(TensorRT-LLM's `/metrics` is JSON iteration stats; an OpenAI-compatible server may answer
every path with its web UI, labelled `text/plain` or not): one such line after ours makes
Prometheus reject the whole scrape, the sidecar's own families included. So every line is
checked, and a body with one line that is not a comment or a sample is not merged at all.
"""

from __future__ import annotations

from proxy.metrics.labels import PREFIX

__all__ = ["engine_exposition", "is_exposition_line"]

_NAME_START = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:")
_NAME_CHARS = bytes(sorted(_NAME_START)) + b"0123456789"


def engine_exposition(body: bytes) -> bytes | None:
    """The engine's text, made safe to append to ours; None when it is not the exposition format.

    Drops OpenMetrics' `# EOF` (it must end the whole exposition, which ours does not) and
    `# UNIT` lines, and any family named like ours (two `# TYPE` lines for one name make
    Prometheus reject the whole scrape).
    """
    lines = body.splitlines()
    if not all(map(is_exposition_line, lines)):
        return None
    if b"# EOF" in body or b"# UNIT" in body or PREFIX.encode() in body:
        body = b"\n".join(line for line in lines if not _foreign_line(line))
    if body and not body.endswith(b"\n"):
        body += b"\n"
    return body


def is_exposition_line(line: bytes) -> bool:
    """A blank line, a `#` comment, or `name[{labels}] value [timestamp]` (no regex: the body is the engine's)."""
    stripped = line.strip()
    if not stripped or stripped.startswith(b"#"):
        return True
    if stripped[0] not in _NAME_START:
        return False
    brace = stripped.find(b"{")
    if brace >= 0:
        close = stripped.rfind(b"}")  # a `}` inside a quoted label value comes before the last one
        if close < brace:
            return False
        name, rest = stripped[:brace], stripped[close + 1 :]
    else:
        name, _, rest = stripped.partition(b" ")
    if name.translate(None, _NAME_CHARS):  # what is left is not a name's character
        return False
    fields = rest.split()
    if not 1 <= len(fields) <= 2:
        return False
    try:
        for field in fields:
            float(field)
    except ValueError:
        return False
    return True


def _foreign_line(line: bytes) -> bool:
    """Whether a line of the engine's text must not reach the merged exposition."""
    stripped = line.strip()
    if stripped == b"# EOF" or stripped.startswith(b"# UNIT "):
        return True
    if stripped.startswith((b"# HELP ", b"# TYPE ")):
        return stripped[7:].lstrip().startswith(PREFIX.encode())
    return stripped.startswith(PREFIX.encode())
