"""Per-event cost of the stream scanner: µs per SSE event, passed through and stripped.

    .venv/bin/python bench/scanner_cost.py [--events 20000] [--rounds 9]

The sidecar's CPU per streamed token is mostly this scanner. Streams are shaped as the
engines write them (a ~250-byte chat chunk per token, then the finish and usage chunks),
delivered one event per read (an engine at decode speed), or 100 or 256 events per read (bursts).
CPU time of this process, best of the rounds: on a shared machine that is the figure that holds.
Run it with PYTHONPATH pointing at another checkout to compare versions: it speaks both the
`StreamScanner(rules)` API and the older `StreamScanner(strip_injected=...)`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Protocol

import orjson

from proxy import observe


class Scanner(Protocol):
    """What the cost is measured on, in either API version."""

    def feed(self, chunk: bytes) -> bytes: ...

    def finish(self) -> bytes: ...

    @property
    def usage(self) -> object: ...


def scanner_factory(strip: bool, null_usage: bool) -> Callable[[], Scanner]:
    """A maker of scanners for either API version."""
    rules_type = getattr(observe, "StreamRules", None)
    if rules_type is not None:
        rules = rules_type(null_usage_added=null_usage) if strip else None
        return lambda: observe.StreamScanner(rules)
    # The older API (a checkout before StreamRules) took the two switches as keywords.
    legacy: Callable[..., Scanner] = observe.StreamScanner
    return lambda: legacy(strip_injected=strip, strip_null_usage=null_usage)


def stream(tokens: int, *, include_usage: bool, null_usage: bool) -> list[bytes]:
    """One stream's events, each a complete `data:` event."""
    head = {"id": "chatcmpl-8f3a9c1e2b7d4f60a1c3e5b7d9f1a3c5", "object": "chat.completion.chunk",
            "created": 1764500000, "model": "Qwen/Qwen2.5-0.5B-Instruct"}  # fmt: skip
    events = []
    for index in range(tokens):
        chunk = {**head, "choices": [{"index": 0, "delta": {"content": f" word{index}"}, "logprobs": None,
                                      "finish_reason": None}]}  # fmt: skip
        if include_usage and null_usage:
            chunk["usage"] = None
        events.append(chunk)
    events.append(
        {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]}
    )
    if include_usage:
        usage = {"prompt_tokens": 900, "total_tokens": 900 + tokens, "completion_tokens": tokens,
                 "prompt_tokens_details": {"cached_tokens": 512}}  # fmt: skip
        events.append({**head, "choices": [], "usage": usage, "system_fingerprint": "fp"})
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def per_event_us(make: Callable[[], Scanner], reads: list[bytes], events: int, total: int) -> float:
    """µs per event to scan `total` events, fed as `reads` again and again."""
    streams = max(1, total // events)
    started = time.process_time()
    for _ in range(streams):
        scanner = make()
        for read in reads:
            scanner.feed(read)
        scanner.finish()
        scanner.usage  # noqa: B018
    return 1e6 * (time.process_time() - started) / (streams * events)


def main() -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20000, help="events scanned per round and case")
    parser.add_argument("--rounds", type=int, default=9)
    ns = parser.parse_args()
    tokens = 256
    cases = []
    for label, strip, null in (
        ("passed through (not injected)", False, False),
        ('stripped, `"usage":null` on every chunk (OpenAI, mindnano)', True, True),
        ("stripped, no nulls (vLLM)", True, False),
    ):
        events = stream(tokens, include_usage=strip, null_usage=null)
        cases.append((label + ", 1 event per read", scanner_factory(strip, null), events, len(events)))
        for size in (100, 256):
            # 100: the last read (59 events) carries content chunks, then the finish and usage chunks.
            bursts = [b"".join(events[i : i + size]) for i in range(0, len(events), size)]
            cases.append(
                (f"{label}, {size} events per read", scanner_factory(strip, null), bursts, len(events))
            )
    print(
        f"stream scanner, µs per event (median of {ns.rounds} rounds of {ns.events} events; module {observe.__file__})\n"
    )
    print("| case | µs/event | spread |")
    print("|---|---:|---:|")
    for label, make, reads, count in cases:
        samples = [per_event_us(make, reads, count, ns.events) for _ in range(ns.rounds)]
        print(f"| {label} | {min(samples):.2f} | {statistics.median(samples):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
