"""Issue 45 M1 on the real vLLM: a request its parser reads otherwise than ours never switches the
usage injection off for the clients after it.

`"stream":true,"str\\u0065am":false` is a stream to a scanner that compares raw member names and not
one to vLLM (Python's json: the escaped name is `stream`, the last one wins); the `NaN`, which
orjson refuses and Python's json takes, sends the body to the byte scanner. Before the fix the
sidecar injected `stream_options`, vLLM refused it (400: stream_options without stream), the resend
without it succeeded, and the refusal was remembered: the next client's stream went uninjected.
"""

from __future__ import annotations

import re

import aiohttp

from tests.real.conftest import Pair
from tests.real.sidecar_client import long_prompt, new_case, observations, stream, tags
from tests.support.client import CLIENT_TIMEOUT

MODEL = "tiny"
# vLLM's HTTP instrumentation (prometheus-fastapi-instrumentator, status codes grouped).
_REFUSED = re.compile(
    r'^http_requests_total\{(?=[^}]*handler="/v1/completions")(?=[^}]*status="4xx")[^}]*\}\s+(\S+)$', re.M
)


async def refused_completions(s: aiohttp.ClientSession, pair: Pair) -> float:
    """How many /v1/completions vLLM has answered with a 4xx so far."""
    async with s.get(f"{pair.engine_url}/metrics") as response:
        text = await response.text()
    return sum(float(found) for found in _REFUSED.findall(text))


async def test_a_parser_differential_request_leaves_injection_on_for_the_next_client(vllm: Pair) -> None:
    session, case = new_case()
    attack = (
        b'{"model":"tiny","prompt":"hello there","max_tokens":2,"stream":true,"str\\u0065am":false,"x":NaN}'
    )
    headers = {"Content-Type": "application/json", **tags(session, case)}
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        refused_before = await refused_completions(s, vllm)
        async with s.post(f"{vllm.url}/v1/completions", data=attack, headers=headers) as response:
            # vLLM reads it as a non-streaming request and answers it whole.
            assert response.status == 200, await response.text()
            assert response.content_type == "application/json"
            await response.read()
        answered = await stream(
            s, vllm.url, {"model": MODEL, "prompt": long_prompt(), "max_tokens": 2}, tags(session, case)
        )
        records = await observations(s, vllm.url, case, 2)
        refused = await refused_completions(s, vllm) - refused_before
    assert answered.done
    # Sent as written: nothing injected into the body vLLM reads differently, so vLLM refused
    # nothing (an injected stream_options beside its non-stream is its 400, then a resend).
    assert records[0]["usage_injected"] is False
    assert refused == 0
    # The next client's stream is injected and its cached tokens read, as before the attack.
    assert records[1]["stream"] is True and records[1]["usage_injected"] is True
    assert records[1]["cached_tokens"] == 0
    # The client that did not ask for usage gets no usage chunk.
    assert not any(event.get("usage") for event in answered.events)
