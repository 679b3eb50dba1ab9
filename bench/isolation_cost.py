"""What isolating a request costs: CPU per isolated request over a non-isolated one, in process.

    .venv/bin/python bench/isolation_cost.py [--rounds 7] [--number 20000]

A focused micro-bench of the rewrite path (not the paced bench: the paced 400/s case of
bench/paced.py needs the whole deployment). For three bodies — a small chat (≈120 B), a 4 KB
chat, a 220 KB prompt — it times what every observed request does already (`prepare_request`,
the include_usage injection included) and what an isolated request adds, each with the
sidecar's own functions: the header read, the case lookup, the engine's rule, the salt written
byte-wise (`isolated_body`: `secrets` for 128 bits, the top-level scan, one copy of the body),
the body read again (`prepare_request` on the rewritten bytes), the answer's result and the
case's tally. The table gives the median of `--rounds` timeit rounds per body, in µs per request.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson
from multidict import CIMultiDict

from proxy.engines.base import EngineInfo
from proxy.forward.ids import SESSION_ID_CHARS, stored_id
from proxy.isolation import Isolation, header_asks, isolated_body, request_result, rule_for
from proxy.observe import prepare_request
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


def _isolated_cost(body: bytes, isolation: Isolation, engine: EngineInfo) -> None:
    """What an isolated request adds, in the order the exchange runs it."""
    headers = CIMultiDict({"X-Cachewitness-Isolation": "request", "X-Session-Id": "s", "X-Case-Id": "c"})
    asked = header_asks(headers)
    session_id = stored_id(headers.get("X-Session-Id"), SESSION_ID_CHARS)
    case_id = stored_id(headers.get("X-Case-Id"), SESSION_ID_CHARS)
    assert isolation.wanted(asked, session_id, case_id)
    rule = rule_for(engine, PATH)
    assert rule is not None
    prepare_request(isolated_body(body, rule), inject_usage=True, path=PATH)
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
        plain = [
            t / number * 1e6
            for t in timeit.repeat(
                lambda body=body: prepare_request(body, inject_usage=True, path=PATH), number=number, repeat=ns.rounds
            )
        ]
        added = [
            t / number * 1e6
            for t in timeit.repeat(
                lambda body=body: _isolated_cost(body, isolation, engine), number=number, repeat=ns.rounds
            )
        ]
        base, extra = statistics.median(plain), statistics.median(added)
        print(f"| {name} | {base:.2f} | {extra:.2f} | {(base + extra) / base:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
