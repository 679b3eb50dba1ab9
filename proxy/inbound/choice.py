"""Which server takes a client request, and why: every rule of what the front takes, in one place.

The front (proxy/inbound/front.py) serves plain inference requests without aiohttp's
per-request machinery; aiohttp serves everything else, as it always did, and every later request
of that connection. A request the front declines costs nothing but its head's parse: aiohttp
answers it (its own 400 for a head that is not HTTP, 413, 417, the route policy's answers).
The reason goes to the log at debug level.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

from multidict import CIMultiDictProxy

from proxy.inbound.framing import MAX_HEAD_BYTES
from proxy.inbound.head import RequestHead
from proxy.vocabulary import ServedBy

__all__ = [
    "BUDGET_SHORT",
    "FRONT_OFF",
    "HEAD_TOO_LARGE",
    "PROBE_SLOT",
    "TAKEN",
    "Choice",
    "FrontRules",
    "choose",
    "plain_target",
]

# A body past this is aiohttp's to read: beside its bytes aiohttp's per-request cost is small, and
# its reader waits for the budget and makes younger readers give way (proxy/body_budget.py), which
# the front, reading as bytes arrive, cannot. A long-context prompt (~220 KB) stays the front's.
MAX_FRONT_BODY = 1024 * 1024
# A target the front takes: origin-form, no query, no escape, no dot segment, no empty segment
# (a trailing slash aside). Anything else has spellings engines read differently
# (proxy/admin/policy.py): aiohttp and the route policy judge it. Checked by a set and two
# substring scans, each linear: a regex with a repeated group of optional parts tried 2^n splits of an
# n-letter segment before refusing a `?` after it (issue 45: 79 bytes held the loop 75 s).
_TARGET_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._~-/")


class Choice(NamedTuple):
    """Who serves a request, and why."""

    served_by: ServedBy
    reason: str


def _aiohttp(reason: str) -> Choice:
    return Choice(ServedBy.AIOHTTP, reason)


TAKEN = Choice(ServedBy.FRONT, "a plain POST the route policy forwards, within the limits")
FRONT_OFF = _aiohttp("front = false")
PROBE_SLOT = _aiohttp("a connection let in past max_connections, for one probe")
HEAD_TOO_LARGE = _aiohttp("no head end within the front's head limit")
BUDGET_SHORT = _aiohttp("the body did not fit max_buffered_bytes as it arrived")
_NOT_HTTP = _aiohttp("a head httptools does not read")
_NOT_1_1 = _aiohttp("not HTTP/1.1")
_PAST_LIMITS = _aiohttp("past aiohttp's head limits (a field, the header count, the target)")
_NOT_ONE_HOST = _aiohttp("not exactly one Host")
_NOT_PLAIN = _aiohttp("a target that is not a plain path (query, escape, dot or empty segment)")
_NO_LENGTH = _aiohttp("not exactly one Content-Length that is a length")
_NOT_UTF8 = _aiohttp("a header value that is not UTF-8")
_NOT_POST = _aiohttp("not a POST")
_TOO_LARGE = _aiohttp("a body past max_body_bytes or the front's 1 MiB")
_OWN_ROUTE = _aiohttp("one of the sidecar's own routes")
_NO_BUDGET = _aiohttp("a body that does not fit max_buffered_bytes now")
_ADMIN_TOKEN = _aiohttp("a header holds the admin token")
_NOT_FORWARDED = _aiohttp("a route the route policy does not forward as it is")
_DECLINED = {name: _aiohttp(f"a {name} header") for name in ("transfer-encoding", "expect", "upgrade")}


class FrontRules(Protocol):
    """What the choice reads of the app beside the head (the front's `Front`)."""

    max_body: int  # max_body_bytes, and at most MAX_FRONT_BODY
    own: tuple[str, ...]  # the starts of the paths the sidecar's own routes answer

    def fits(self, size: int) -> bool:
        """Whether a body of `size` fits max_buffered_bytes now."""
        ...

    def holds_admin_token(self, headers: CIMultiDictProxy[str]) -> bool:
        """Whether a header holds the admin token (it must be taken out: aiohttp's)."""
        ...

    def forwards(self, method: str, path: str, query: Mapping[str, str]) -> bool:
        """Whether the route policy forwards this request as it is."""
        ...


_NO_QUERY: Mapping[str, str] = {}


def plain_target(target: str) -> bool:
    """Whether `target` is a plain path: `/`, then segments of letters, digits and `._~-` that do
    not start with a dot, joined by single slashes, with at most one slash at the end.

    Three scans in C: a character outside the set (`?`, `%`, `;`, `:`...) is refused first.
    """
    return (
        target[:1] == "/" and _TARGET_CHARS.issuperset(target) and "//" not in target and "/." not in target
    )


def choose(head: RequestHead | None, rules: FrontRules) -> Choice:
    """Which server takes the request that begins with `head` (None: httptools could not read it)."""
    if head is None:
        return _NOT_HTTP
    if head.version != "1.1":
        return _NOT_1_1
    if not head.within_limits or head.size > MAX_HEAD_BYTES:
        return _PAST_LIMITS
    if head.hosts != 1:
        return _NOT_ONE_HOST
    if not plain_target(head.path):
        return _NOT_PLAIN
    if head.declined_header is not None:
        return _DECLINED[head.declined_header]
    if head.lengths != 1 or head.content_length is None:
        return _NO_LENGTH
    if not head.utf8:
        return _NOT_UTF8
    if head.method != "POST":
        return _NOT_POST
    if head.content_length > rules.max_body:
        return _TOO_LARGE
    if head.path.startswith(rules.own):
        return _OWN_ROUTE  # a reset, a case's close: the sidecar's own routes are aiohttp's
    if not rules.fits(head.content_length):
        return _NO_BUDGET  # aiohttp streams it unobserved, and counts it
    if rules.holds_admin_token(head.headers):
        return _ADMIN_TOKEN
    if not rules.forwards(head.method, head.path, _NO_QUERY):
        return _NOT_FORWARDED
    return TAKEN
