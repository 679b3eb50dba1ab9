"""What isolating a request costs: CPU per isolated request over a non-isolated one, in process.

    .venv/bin/python bench/isolation_cost.py [--rounds 7] [--number 20000]

A focused micro-bench of the rewrite path (not the paced bench: the paced 400/s case of
bench/paced.py needs the whole deployment). For three bodies — a small chat (≈120 B), a 4 KB
chat, a 220 KB prompt — it times what every observed request does already (`prepare_request`,
the include_usage injection included) and what an isolated request adds, each with the
sidecar's own functions: the header read, the case lookup, the engine's rule, the salt written
byte-wise (`isolated_request`: `secrets` for 128 bits, a small body decoded whole or a large one
scanned, one copy of the body, the injection moved to match), the answer's result and the
case's tally. The table gives the fastest of `--rounds` timeit rounds per body (the machine is shared: the
fastest round is the one least disturbed), in µs per request.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson
from multidict import CIMultiDict

from proxy.engines.base import EngineInfo
from proxy.forward.ids import SESSION_ID_CHARS, stored_id
from proxy.isolation import Isolation, header_asks, isolated_request, request_result, rule_for
from proxy.observe import PreparedRequest, prepare_request
from proxy.vocabulary import EngineKind, IsolationMode

PATH = "/v1/chat/completions"


def _bodies() -> list[tuple[str, bytes]]:
    """The three request bodies, streamed (so the include_usage injection applies too)."""

    def chat(content: str) -> bytes:
        message = {"role": "user", "content": content}
        return orjson.dumps({"model": "m", "messages": [message], "max_tokens": 16, "stream": True})

    return [
        ("chat ≈120 B", chat("What is the capital of France?")),
        ("chat 4 KB", chat("lorem ipsum dolor " * 220)),
        ("prompt 220 KB", chat("lorem ipsum dolor sit amet " * 8150)),
    ]


HEADERS = CIMultiDict({"X-Cachewitness-Isolation": "request", "X-Session-Id": "s", "X-Case-Id": "c"})


def _prepared(body: bytes) -> PreparedRequest:
    """What every observed request does already."""
    return prepare_request(body, inject_usage=True, path=PATH)


def _isolated_cost(prepared: PreparedRequest, isolation: Isolation, engine: EngineInfo) -> None:
    """What an isolated request adds, in the order the exchange runs it."""
    headers = HEADERS
    asked = header_asks(headers)
    session_id = stored_id(headers.get("X-Session-Id"), SESSION_ID_CHARS)
    case_id = stored_id(headers.get("X-Case-Id"), SESSION_ID_CHARS)
    assert isolation.wanted(asked, session_id, case_id)
    rule = rule_for(engine, PATH)
    assert rule is not None
    isolated_request(prepared, rule)
    isolation.counted(session_id, case_id, request_result(0))


def main() -> int:
    """Time each body both ways and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=20000)
    ns = parser.parse_args()
    engine = EngineInfo(kind=EngineKind.VLLM, version="0.32.0")
    isolation = Isolation(IsolationMode.NONE, idle_s=30.0, write=lambda _r: None, count=lambda _r: None)
    print("| body | every observed request (µs) | isolation adds (µs) | isolated / not |")
    print("|---|---:|---:|---:|")
    for name, body in _bodies():
        number = max(50, ns.number // max(1, len(body) // 4096))
        prepared = _prepared(body)
        assert prepared.usage_injected  # the injection is moved to match the isolation
        plain = timeit.repeat(partial(_prepared, body), number=number, repeat=ns.rounds)
        added = timeit.repeat(
            partial(_isolated_cost, prepared, isolation, engine), number=number, repeat=ns.rounds
        )
        base, extra = (min(times) / number * 1e6 for times in (plain, added))
        print(f"| {name} | {base:.2f} | {extra:.2f} | {(base + extra) / base:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
