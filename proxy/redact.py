"""Credentials out of URLs before they are logged or written as evidence."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

__all__ = ["redact_url"]

MASK = "***"
# Query parameter names that carry credentials (matched as substrings, case-insensitive).
_SECRET_NAMES = ("key", "token", "secret", "password", "passwd", "pwd", "auth", "signature", "credential")
_USERINFO = re.compile(r"//[^/@?#]*@")


def _is_secret_name(name: str) -> bool:
    """True when a query parameter's name says it carries a credential."""
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_NAMES)


def _redact_query(query: str) -> str:
    """Mask the values of credential-like query parameters, keeping everything else byte for byte."""
    parts = []
    for part in query.split("&"):
        name, sep, _value = part.partition("=")
        parts.append(f"{name}={MASK}" if sep and _is_secret_name(name) else part)
    return "&".join(parts)


def redact_url(url: str) -> str:
    """`url` with `user:password@` and credential-like query values replaced by `***`; never raises."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = f"{MASK}@{netloc.rpartition('@')[2]}"
        return urlunsplit((parts.scheme, netloc, parts.path, _redact_query(parts.query), parts.fragment))
    except ValueError:
        # Unparseable (e.g. a bad IPv6 literal): mask anything that looks like userinfo and the whole query.
        return _USERINFO.sub(f"//{MASK}@", url.split("?", 1)[0]) + (f"?{MASK}" if "?" in url else "")
