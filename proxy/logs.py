"""Structured JSON log lines on stderr, one object per line, for a log shipper (docs/operations.md).

Every line starts with the same four keys: `ts` (UTC, RFC 3339 with milliseconds), `level`
(`debug` … `critical`), `logger` (`cachewitness.<concern>`, or a library's name) and `msg`;
a line about one of the sidecar's events adds `event` and that event's fields. A field never
replaces those four. Evidence records, when `evidence_stdout` is on, go to stdout instead, so
the two streams never mix.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

__all__ = ["ClientTracebackThrottle", "LogThrottle", "log_event", "setup_logging"]

_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then any `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        """Render the record as a single JSON line."""
        payload: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_") and key not in payload:
                payload[key] = value
        if record.exc_info and record.levelno >= logging.ERROR:
            payload["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(payload, default=str).decode()


# Libraries that log a traceback for what a client sent: aiohttp for each malformed request, asyncio
# for an exception out of a protocol callback. One client can send thousands a second (issue 45:
# 2,000 requests, 2 MB of log), so each kind of line is let through once per LogThrottle period.
_CLIENT_TRACEBACKS = frozenset({"aiohttp.server", "asyncio"})


class ClientTracebackThrottle(logging.Filter):
    """Lets one traceback line a period through per logger and message; the line says how many it stands for."""

    def __init__(self) -> None:
        super().__init__()
        self._throttle = LogThrottle()

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether `record` goes out (a line with a traceback from a library above: when due)."""
        if record.exc_info is None or record.name not in _CLIENT_TRACEBACKS:
            return True
        count = self._throttle.due(f"{record.name} {record.msg}")
        if not count:
            return False
        record.repeated = count  # this line and those held back since the last one
        return True


def setup_logging(level: str = "info") -> None:
    """Send every `cachewitness.*` logger to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(ClientTracebackThrottle())
    root = logging.getLogger("cachewitness")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # aiohttp's own error logs (e.g. a handler that raised) in the same format.
    aio = logging.getLogger("aiohttp")
    aio.handlers[:] = [handler]
    aio.setLevel(logging.WARNING)
    aio.propagate = False
    # Everything else (asyncio's "Task exception was never retrieved", Python warnings, any
    # library) through the root logger in the same format, not logging's plain-text last resort.
    base = logging.getLogger()
    base.handlers[:] = [handler]
    base.setLevel(logging.WARNING)
    logging.captureWarnings(True)


def log_event(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log `msg` with structured fields (never pass prompts, keys or user values)."""
    logger.log(level, msg, extra=fields)


class LogThrottle:
    """At most one log line per key per `every_s`: a flood of one event must not flood the log."""

    def __init__(self, every_s: float = 10.0) -> None:
        """Allow one line per key per `every_s` seconds."""
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def due(self, key: str) -> int:
        """Count one event; the events since the last line (this one included) when a line is due, else 0."""
        self._since[key] = self._since.get(key, 0) + 1
        now = time.monotonic()
        if now - self._last.get(key, -self.every_s) < self.every_s:
            return 0
        self._last[key] = now
        count, self._since[key] = self._since[key], 0
        return count
