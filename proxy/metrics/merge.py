"""The engine's own /metrics text (fetched by proxy/engines/queries.py), made safe to append to the sidecar's."""

from __future__ import annotations

from proxy.metrics.labels import PREFIX


def engine_exposition(body: bytes) -> bytes:
    """The engine's text, made safe to append to ours.

    Drops OpenMetrics' `# EOF` (it must end the whole exposition, which ours does not) and
    `# UNIT` lines, and any family named like ours (two `# TYPE` lines for one name make
    Prometheus reject the whole scrape).
    """
    if b"# EOF" in body or b"# UNIT" in body or PREFIX.encode() in body:
        kept = [line for line in body.splitlines() if not _foreign_line(line)]
        body = b"\n".join(kept)
    if body and not body.endswith(b"\n"):
        body += b"\n"
    return body


def _foreign_line(line: bytes) -> bool:
    """Whether a line of the engine's text must not reach the merged exposition."""
    stripped = line.strip()
    if stripped == b"# EOF" or stripped.startswith(b"# UNIT "):
        return True
    if stripped.startswith((b"# HELP ", b"# TYPE ")):
        return stripped[7:].lstrip().startswith(PREFIX.encode())
    return stripped.startswith(PREFIX.encode())
