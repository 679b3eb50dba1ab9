"""What measuring the sidecar's added time costs per request: the code issue 50 added to the request path, timed.

    .venv/bin/python bench/overhead_cost.py [--number 200000]

A paced run's rounds disagree by 5-15 % (tens of µs per request), far above the ≤ 3 µs this
code may cost, so it is timed by itself (timeit, warm): each statement the request path gained,
on the real objects, in the order one front-served JSON request runs them (one read from the
client, one write to the engine, one read of its answer, one write to the client), then what the
record and the metrics do with the two spans. Warm figures are a floor: at a paced load the
request runs cold (bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.forward.exchange import Exchange
from proxy.metrics.hot import HotHistogram
from proxy.metrics.labels import ADDED_BUCKETS
from proxy.observe import Observation
from proxy.observe.overhead import OverheadQuantiles, elapsed_us, now_ns, overhead_member
from proxy.observe.record import Forwarded
from proxy.upstream.response import UpstreamResponse
from proxy.vocabulary import Outcome, ServedBy


class _Carrier:
    def taken(self) -> None: ...

    def abandon(self, response: UpstreamResponse) -> None: ...


class _Side:
    read_ns = 0


# A step timed as the difference of two statements: "A <minus> B".
_MINUS = "<minus>"
_REPEAT = 15
# Every field before the two spans, positionally (as proxy/forward/exchange.py builds them).
_OBS = ("r", None, None, "POST", "/v1/chat/completions", 200, False, "m", 3, 1, 0, "usage", None, None, 1, 2, 3,
        Outcome.OK, False, None, False, None)  # fmt: skip
_FWD = ("POST", "/v1/chat/completions", 200, Outcome.OK, 1, 2, 3, 0.0, 0.0, ServedBy.FRONT, False)


def _steps() -> dict[str, str]:
    """Each statement the request path gained, as code timed on the objects in `_setup`."""
    return {
        "client read mark (per client read)": "side.read_ns = now_ns()",
        "exchange takes the mark": "exchange.read_ns = side.read_ns",
        "last byte written to the engine": "upstream.sent_ns = now_ns() if upstream.writer is None else 0",
        "answer head read": "upstream.answer_read_ns = now_ns()",
        "first body read (per engine read)": "upstream.body_read_ns or None",
        "added_in computed": "exchange.added_in_us = elapsed_us(upstream.streamed_in_ns or exchange.read_ns, upstream.sent_ns)",
        "event_stream and the header switch": "exchange.event_stream = False; settings_header or None",
        "added_out computed at the first write": "exchange.added_out_us = elapsed_us(upstream.answer_read_ns, now_ns())",
        "metrics: two histogram observes": "hist_in.observe(exchange.added_in_us / 1e6); hist_out.observe(exchange.added_out_us / 1e6)",
        "the case's quantiles": "quantiles.add(exchange.added_in_us, exchange.added_out_us)",
        "the record's overhead member (at the flush)": "overhead_member(exchange.added_in_us, exchange.added_out_us)",
        "the engine response's four marks set to 0": "u = upstream; u.sent_ns = 0; u.streamed_in_ns = 0; "
        "u.answer_read_ns = 0; u.body_read_ns = 0",
        "Observation and Forwarded: two fields more each": f"observation(*OBS, 1, 2); forwarded(*FWD, 1, 2)"
        f" {_MINUS} observation(*OBS); forwarded(*FWD)",
    }


def _setup() -> dict[str, object]:
    loop = asyncio.new_event_loop()
    exchange = Exchange("r", 0)
    exchange.added_in_us, exchange.added_out_us = 31, 42
    return {
        "now_ns": now_ns,
        "elapsed_us": elapsed_us,
        "overhead_member": overhead_member,
        "side": _Side(),
        "exchange": exchange,
        "upstream": UpstreamResponse(_Carrier(), loop.create_future()),
        "settings_header": False,
        "hist_in": HotHistogram((*ADDED_BUCKETS, float("inf"))),
        "hist_out": HotHistogram((*ADDED_BUCKETS, float("inf"))),
        "quantiles": OverheadQuantiles(),
        "observation": Observation,
        "forwarded": Forwarded,
        "OBS": _OBS,
        "FWD": _FWD,
    }


def _best(code: str, names: dict[str, object], number: int) -> float:
    """Seconds per run of `code`, the best of _REPEAT repeats (the least disturbed by other work)."""
    return min(timeit.repeat(code.strip(), globals=names, number=number, repeat=_REPEAT)) / number


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=200_000, help="runs of each statement (best of 15)")
    ns = parser.parse_args()
    names = _setup()
    empty = _best("pass", names, ns.number)
    total = 0.0
    print(f"{'statement':48s} ns (warm, best of 15, loop overhead taken out)")
    for what, code in _steps().items():
        timed, _, minus = code.partition(_MINUS)
        base = _best(minus, names, ns.number) if minus else empty
        cost = max(0.0, _best(timed, names, ns.number) - base) * 1e9
        total += cost
        print(f"{what:48s} {cost:6.0f}")
    print(f"{'per request, all of it':48s} {total:6.0f}  (= {total / 1000:.2f} µs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
