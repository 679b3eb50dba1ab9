"""Differential: the same deterministic request, direct and through the sidecar, on real engines.

Bodies and headers must be equal except where two direct calls also differ (ids, times,
cache counts) and except the header changes docs/routes.md lists. Each case calls the
engine directly twice, before and after the call through the sidecar, to learn what varies on its own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from proxy.forward.headers import HOP_BY_HOP
from tests.real.conftest import Pair
from tests.support.client import CLIENT_TIMEOUT

MODEL = "tiny"
PROMPT = "Say the alphabet backwards, slowly, one letter at a time, and explain each step."
# Header changes docs/routes.md's table lists for an answer (hop-by-hop framing included).
SIDECAR_HEADERS = HOP_BY_HOP | {"x-accel-buffering"}
# ...and those aiohttp writes when the engine sent none (llama-server sends no Date).
ADDED_IF_ABSENT = {"date", "server"}
CASES: dict[str, dict[str, Any]] = {
    "json": {"stream": False},
    "stream": {"stream": True},
    "stream-include-usage": {"stream": True, "stream_options": {"include_usage": True}},
}
# A JSON scalar after a member name (the value a volatile member's name is masked with).
_SCALAR = rb'\s*:\s*("(?:[^"\\]|\\.)*"|-?[0-9][0-9.eE+-]*|true|false|null)'


@dataclass(frozen=True)
class Answer:
    """One answer as the client received it."""

    status: int
    headers: dict[str, str]
    body: bytes

    def documents(self) -> list[Any]:
        """The JSON body, or each SSE event's data."""
        if not self.body.startswith(b"data:"):
            return [json.loads(self.body)]
        lines = (line[5:].strip() for line in self.body.splitlines() if line.startswith(b"data:"))
        return [json.loads(line) for line in lines if line and line != b"[DONE]"]


async def ask(url: str, body: dict[str, Any]) -> Answer:
    """POST a chat completion with a fresh connection, reading the body as bytes (no decoding)."""
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT, auto_decompress=False) as s,
        s.post(f"{url}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as resp,
    ):
        return Answer(resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read())


def _leaves(doc: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    """Every scalar in a decoded document, by its path."""
    if isinstance(doc, dict):
        return {p: v for key, item in doc.items() for p, v in _leaves(item, (*path, key)).items()}
    if isinstance(doc, list):
        return {p: v for index, item in enumerate(doc) for p, v in _leaves(item, (*path, index)).items()}
    return {path: doc}


def volatile_members(first: Answer, second: Answer) -> set[str]:
    """Names of the members whose values differ between two direct answers to one request.

    Events are paired in order, as far as both answers go: ids and times are in every event.
    """
    one, two = first.documents(), second.documents()
    names = set()
    for a, b in zip(one, two, strict=False):
        left, right = _leaves(a), _leaves(b)
        names |= {str(path[-1]) for path in left.keys() | right.keys() if left.get(path) != right.get(path)}
    return names


def carried(answer: Answer, names: set[str]) -> dict[str, Any]:
    """What a stream carries, whatever its chunking: the text, and every member but the volatile ones.

    vLLM hands a client the deltas its output queue holds when the client's read comes, so
    two direct calls can split the same tokens into different events (13 events, then 14;
    a UTF-8 character held back in one and not the other). Byte equality of streams is then
    not the engine's own behaviour; what the events carry is.
    """
    docs = answer.documents()
    text = "".join(
        choice.get("delta", {}).get("content") or "" for doc in docs for choice in doc.get("choices", [])
    )
    members = {
        (tuple("*" if isinstance(key, int) else key for key in path), None if path[-1] in names else value)
        for doc in docs
        for path, value in _leaves(doc).items()
        if path[-1] != "content"
    }
    return {"text": text, "events_end": answer.body[-14:], "members": members}


def masked(body: bytes, names: set[str]) -> bytes:
    """The body with the value of every member of these names replaced by `_`, byte for byte elsewhere."""
    for name in names:
        key = re.escape(json.dumps(name).encode())
        body = re.sub(key + _SCALAR, key + b":_", body)
    return body


@pytest.mark.parametrize("case", sorted(CASES))
async def test_through_the_sidecar_the_client_gets_the_engines_own_answer(
    any_engine: Pair, case: str
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 12,
        "temperature": 0,
        "seed": 7,
        **CASES[case],
    }
    # The call through the sidecar sits between the two direct ones, so a value stamped from a
    # clock (`created`, in seconds) that the direct calls share was stamped in that same second
    # for it too: a value only a second boundary changed is not taken for the sidecar's doing.
    first = await ask(any_engine.engine_url, body)
    through = await ask(any_engine.url, body)
    second = await ask(any_engine.engine_url, body)
    assert first.status == second.status == through.status == 200, through.body[:300]

    names = volatile_members(first, second)
    if body["stream"]:
        assert carried(through, names) == carried(first, names)
    else:
        assert masked(through.body, names) == masked(first.body, names)

    varying = {
        name
        for name in first.headers.keys() | second.headers.keys()
        if first.headers.get(name) != second.headers.get(name)
    }
    allowed = SIDECAR_HEADERS | varying | (ADDED_IF_ABSENT - first.headers.keys())
    if case == "stream":
        allowed |= {"content-length"}  # an injected stream goes out chunked (docs/routes.md)
    direct = {k: v for k, v in first.headers.items() if k not in allowed}
    proxied = {k: v for k, v in through.headers.items() if k not in allowed}
    assert proxied == direct
    if body["stream"]:
        assert through.headers.get("x-accel-buffering") == "no"
