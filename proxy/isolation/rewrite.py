"""An isolated request's body: the engine's isolation member set by inserting bytes, never by re-serialising.

The same byte-level member insertion the include_usage injection uses (proxy/observe/request.py):
the top-level scanner finds the member, a `Splice` replaces its value or appends it before the
object's closing brace, and every other byte the client wrote reaches the engine as written.
"""

from __future__ import annotations

import secrets

import orjson

from proxy.isolation.rules import IsolationRule
from proxy.observe.jsonscan import Buffer, skip_ws_back, top_level_members
from proxy.observe.request import PreparedRequest, Splice

__all__ = ["SALT_BYTES", "Unrewritable", "fresh_salt", "isolated_body"]

# 16 random bytes: 128 bits, 22 URL-safe characters ([A-Za-z0-9_-]: none that vLLM forbids).
SALT_BYTES = 16
_FALSE = b"false"


class Unrewritable(Exception):
    """A body the isolation cannot be written into: the request must not run (a 400)."""


def fresh_salt() -> str:
    """An unpredictable salt no other request shares (`secrets`: the OS's CSPRNG)."""
    return secrets.token_urlsafe(SALT_BYTES)


def _salt_value(rule: IsolationRule, client: object) -> bytes:
    """The JSON string of the salt the engine gets: the client's own salt, if any, then a fresh one.

    The client's salt stays the prefix so that its own isolation holds; only this value is
    encoded, the body around it is left as it is.
    """
    ours = fresh_salt()
    if client is None:
        return orjson.dumps(ours)
    if not isinstance(client, str) or not client:
        raise Unrewritable(
            f"{rule.field} must be a non-empty string; the sidecar keeps it as the prefix of its salt"
        )
    salt = client + ours
    if rule.max_salt_chars is not None and len(salt) > rule.max_salt_chars:
        room = rule.max_salt_chars - len(ours)
        raise Unrewritable(
            f"{rule.field} is {len(client)} characters; with the sidecar's {len(ours)}-character salt after it "
            f"the engine takes at most {rule.max_salt_chars}: send at most {room}"
        )
    return orjson.dumps(salt)


def _member_value(body: Buffer, start: int, end: int) -> object:
    """One member's decoded value; Unrewritable when it is not JSON."""
    try:
        return orjson.loads(bytes(body[start:end]))
    except orjson.JSONDecodeError:
        raise Unrewritable("the body is not valid JSON") from None


def isolated_body(body: Buffer, rule: IsolationRule) -> bytes:
    """`body` with the rule's member set: a fresh salt (the client's kept first), or `false`.

    Raises Unrewritable for a body that is not one JSON object, or a client salt the engine
    could not take with ours after it.
    """
    key = orjson.dumps(rule.field)
    top = top_level_members(body, frozenset({key}))
    if top is None:
        raise Unrewritable("the body must be one JSON object to be isolated")
    member = top.members.get(key)
    if member is not None:
        client = _member_value(body, member.value_start, member.value_end)
        value = _salt_value(rule, client) if rule.salted else _FALSE
        splice = Splice(member.value_start, member.value_end, value)
    else:
        value = _salt_value(rule, None) if rule.salted else _FALSE
        # Appended as the last member, after a comma unless the object is empty (`{}`).
        empty = body[skip_ws_back(body, top.close, 0) - 1] == 0x7B
        splice = Splice(top.close, top.close, (b"" if empty else b",") + key + b":" + value)
    return PreparedRequest(body, stream=False, model=None, injection=splice).upstream_body()
