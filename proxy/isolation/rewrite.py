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

__all__ = [
    "SALT_BYTES",
    "Unrewritable",
    "fresh_salt",
    "isolated_body",
    "isolated_request",
    "isolation_splice",
]

# 16 random bytes: 128 bits, 22 URL-safe characters ([A-Za-z0-9_-]: none that vLLM forbids).
SALT_BYTES = 16
_FALSE = b"false"
_NOT_ONE_OBJECT = "the body must be one JSON object to be isolated"
# Bodies up to this are decoded whole first (as observe/request.py's `_DECODE_WHOLE`).
_DECODE_WHOLE = 16 * 1024


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


def isolation_splice(body: Buffer, rule: IsolationRule) -> Splice:
    """The bytes that set the rule's member: a fresh salt (the client's kept first), or `false`.

    Raises Unrewritable for a body that is not one JSON object, or a client salt the engine
    could not take with ours after it. A small body without the member is decoded whole (1 µs
    for a 120-byte chat, where the scanner takes 7: observe/request.py does the same); the
    member's position is the scanner's to find.
    """
    key = rule.key
    if len(body) <= _DECODE_WHOLE:
        try:
            decoded = orjson.loads(body)
        except orjson.JSONDecodeError:
            decoded = None  # NaN, integers past 64 bits, or no JSON: the scanner decides
        else:
            if not isinstance(decoded, dict):
                raise Unrewritable(_NOT_ONE_OBJECT)
            if rule.field not in decoded:
                # Appended before the closing brace: orjson took the body, so only JSON's
                # whitespace follows it; a comma unless the object is empty.
                close = len(body.rstrip(b" \t\r\n")) - 1
                return Splice(close, close, (b"," if decoded else b"") + key + b":" + _value(rule, None))
    top = top_level_members(body, frozenset({key}))
    if top is None:
        raise Unrewritable(_NOT_ONE_OBJECT)
    member = top.members.get(key)
    if member is not None:
        client = _member_value(body, member.value_start, member.value_end)
        return Splice(member.value_start, member.value_end, _value(rule, client))
    # Appended as the last member, after a comma unless the object is empty (`{}`).
    empty = body[skip_ws_back(body, top.close, 0) - 1] == 0x7B
    return Splice(top.close, top.close, (b"" if empty else b",") + key + b":" + _value(rule, None))


def _value(rule: IsolationRule, client: object) -> bytes:
    """The member's new value: a salt, or `false`."""
    return _salt_value(rule, client) if rule.salted else _FALSE


def isolated_body(body: Buffer, rule: IsolationRule) -> bytes:
    """`body` with the rule's member set (one copy of the body)."""
    return PreparedRequest(
        body, stream=False, model=None, injection=isolation_splice(body, rule)
    ).upstream_body()


def isolated_request(prepared: PreparedRequest, rule: IsolationRule) -> PreparedRequest:
    """The prepared request with the rule's member set; its include_usage injection moved to match.

    The isolated body is a copy, so that the injection's refusal retry (`without_injection`)
    keeps the isolation: an isolated request is never sent without it. The body is read once.
    """
    splice = isolation_splice(prepared.body, rule)
    view = memoryview(prepared.body)
    body = b"".join((view[: splice.start], splice.insert, view[splice.end :]))
    injection = prepared.injection
    if injection is not None and injection.start >= splice.end:
        # After our member (or at the same closing brace, where ours goes first): shifted by what ours added.
        moved = len(splice.insert) - (splice.end - splice.start)
        injection = Splice(injection.start + moved, injection.end + moved, injection.insert)
    return PreparedRequest(body, prepared.stream, prepared.model, injection)
