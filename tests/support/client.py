"""The bound of every HTTP wait a test makes: no test waits on aiohttp's 5-minute default."""

from __future__ import annotations

import aiohttp

__all__ = ["CLIENT_TIMEOUT"]

# Far above anything a passing test waits for (a drained reset holds a request up to its
# drain_timeout, 30 s by default), far below aiohttp's 300 s: a regression fails the test
# that stalls, within its own bound, instead of holding the suite.
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=120, sock_connect=10, sock_read=60)
