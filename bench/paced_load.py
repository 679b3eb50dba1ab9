"""A paced, open-loop load generator: requests at a fixed rate over a keep-alive pool, or paced streams.

    python bench/paced_load.py requests --url URL --rate 400 --connections 48 --seconds 5 [--max-tokens 8]
        [--prompt-bytes 220000] [--cpu-pids 123,124]
    python bench/paced_load.py streams --url URL --streams 100 --max-tokens 200 --seconds 6 [--cpu-pids ...]
    ... [--baseline-url ENGINE_URL --baseline-rate 100 | --baseline-streams 20]

`requests`: chat completions (non-streaming) due at start + k / rate whatever the answers do
(open loop), each sent on an idle connection of the pool (the one idle longest, so every
connection stays in use), queued when none is idle. Latency runs from the send to the whole
answer; `max_lag_ms` says how far behind its schedule the latest send was (the generator's
own core too busy, or the pool exhausted).

`streams`: `--streams` connections, each running streamed chat completions back to back, the
engine pacing the events; the connections start spread over one stream's length so that
streams begin at a steady rate. No stream starts after `--seconds`; the run ends when the last
one has ended, and every event counts. Time to first event runs from the send to the read
that brought the first event.

`--baseline-url` (the engine itself) with `--baseline-rate` (`--baseline-streams`): a smaller
load of the same requests straight to the engine meanwhile, its sends offset by half a step
from the main load's; its latencies (`baseline_*`) are what the engine alone gave at that
time, so that the latency a proxy adds is taken within one run, against the same engine state.

`--cpu-pids`: processes (the proxy and its children) whose CPU the generator reads from
/proc over exactly the measured window: from the first send to the last answer. Raw asyncio
protocols on uvloop with httptools' parser, so the generator costs little. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import cpu_ns, cpu_seconds
from paced_wire import Connection, Tally, host_port, open_connection, request_bytes


class RequestPool:
    """Requests to one URL due at a fixed rate, each on the connection idle longest, queued when none is."""

    def __init__(self, url: str, rate: float, connections: int, seconds: float, request: bytes) -> None:
        """What to send where, how often and for how long."""
        self.host, self.port = host_port(url)
        self.rate, self.connections, self.request = rate, connections, request
        self.total = max(1, round(rate * seconds))
        self.tally = Tally()
        self.idle: collections.deque[Connection] = collections.deque()
        self.waiting = 0  # requests due while no connection was idle
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def open(self) -> None:
        """Open every connection of the pool."""
        conns = await asyncio.gather(
            *(open_connection(self.host, self.port, self.tally, self._done) for _ in range(self.connections))
        )
        self.idle.extend(conns)

    def _done(self, conn: Connection) -> None:
        """An answer ended: a queued request goes out at once on the connection, or it is idle."""
        if self.tally.answers + self.tally.errors >= self.total and not self.finished.done():
            self.finished.set_result(None)
        if conn.failed:
            return
        if self.waiting:
            self.waiting -= 1
            conn.send(self.request)
        else:
            self.idle.append(conn)

    async def offer(self, start: float, on_first: Callable[[], None] = lambda: None) -> None:
        """Send the requests on schedule from loop time `start`; return when every answer is in."""
        loop = asyncio.get_running_loop()
        tally = self.tally
        for k in range(self.total):
            due = start + k / self.rate
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if k == 0:
                on_first()
            tally.max_lag = max(tally.max_lag, loop.time() - due)
            if self.idle:
                self.idle.popleft().send(self.request)
            else:
                tally.queued += 1
                self.waiting += 1
        await asyncio.wait_for(self.finished, 60 + self.total / self.rate)


async def run_requests(ns: argparse.Namespace, pids: list[int]) -> dict[str, object]:
    """Requests due at a fixed rate for `seconds` over a pool of keep-alive connections (and the baseline's)."""
    loop = asyncio.get_running_loop()
    request = request_bytes(ns.url, ns.max_tokens, False, ns.prompt_bytes)
    main = RequestPool(ns.url, ns.rate, ns.connections, ns.seconds, request)
    pools = [main]
    if ns.baseline_url and ns.baseline_rate > 0:
        baseline_request = request_bytes(ns.baseline_url, ns.max_tokens, False, ns.prompt_bytes)
        pools.append(
            RequestPool(
                ns.baseline_url, ns.baseline_rate, ns.baseline_connections, ns.seconds, baseline_request
            )
        )
    await asyncio.gather(*(pool.open() for pool in pools))
    window: dict[str, float] = {}

    def open_window() -> None:  # with the first send
        window.update(cpu0=cpu_ns(pids), ticks0=cpu_seconds(pids), clock0=time.perf_counter())

    start = loop.time() + 0.05
    # The baseline's schedule is offset by half an interval: no send of it coincides with one of the main's.
    await asyncio.gather(
        main.offer(start, open_window), *(pool.offer(start + 0.5 / pool.rate) for pool in pools[1:])
    )
    elapsed = time.perf_counter() - window["clock0"]
    tally = main.tally
    return {
        "mode": "requests",
        "rate": ns.rate,
        "connections": ns.connections,
        "requests": tally.answers,
        "errors": tally.errors + sum(pool.tally.errors for pool in pools[1:]),
        "queued": tally.queued,
        "max_lag_ms": round(tally.max_lag * 1000, 3),
        "achieved_rps": tally.answers / elapsed,
        **_latencies(tally.latencies, ""),
        **(_latencies(pools[1].tally.latencies, "baseline_") if len(pools) > 1 else {}),
        **_cpu(pids, int(window["cpu0"]), window["ticks0"], elapsed),
    }


class StreamSet:
    """Connections each running paced streams back to back until a deadline."""

    def __init__(self, url: str, streams: int, max_tokens: int) -> None:
        """Where to send, how many at once, how long each."""
        self.host, self.port = host_port(url)
        self.streams, self.max_tokens = streams, max_tokens
        self.request = request_bytes(url, max_tokens, True, 0)
        self.tally = Tally()
        self.conns: list[Connection] = []
        self.running = 0
        self.deadline = 0.0
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def open(self) -> None:
        """Open every connection."""
        self.conns = list(
            await asyncio.gather(
                *(open_connection(self.host, self.port, self.tally, self._done) for _ in range(self.streams))
            )
        )

    def _done(self, conn: Connection) -> None:
        """A stream ended: the next one on that connection, or none after the deadline."""
        if not conn.failed and time.perf_counter() < self.deadline:
            conn.send(self.request)
            return
        self.running -= 1
        if self.running == 0 and not self.finished.done():
            self.finished.set_result(None)

    async def run(self, deadline: float, spread: float, offset: float) -> None:
        """Start the streams spread over `spread` s (shifted by `offset` of one step); wait for the last."""
        loop = asyncio.get_running_loop()
        self.deadline = deadline
        start = loop.time()
        step = spread / len(self.conns)
        for i, conn in enumerate(self.conns):
            delay = start + (i + offset) * step - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self.running += 1
            conn.send(self.request)
        await asyncio.wait_for(self.finished, deadline - time.perf_counter() + spread + 60)


async def run_streams(ns: argparse.Namespace, pids: list[int]) -> dict[str, object]:
    """`streams` connections running paced streams back to back until `seconds` have passed (and the baseline's)."""
    main = StreamSet(ns.url, ns.streams, ns.max_tokens)
    sets = [main]
    if ns.baseline_url and ns.baseline_streams > 0:
        sets.append(StreamSet(ns.baseline_url, ns.baseline_streams, ns.baseline_max_tokens or ns.max_tokens))
    await asyncio.gather(*(s.open() for s in sets))
    # One stream lasts about max_tokens / stream_rate s: the starts are spread over that.
    spread = ns.max_tokens / ns.stream_rate
    cpu0, ticks0, clock0 = cpu_ns(pids), cpu_seconds(pids), time.perf_counter()
    deadline = clock0 + ns.seconds
    await asyncio.gather(
        main.run(deadline, spread, 0.0),
        *(s.run(deadline, s.max_tokens / ns.stream_rate, 0.5) for s in sets[1:]),
    )
    elapsed = time.perf_counter() - clock0
    tally = main.tally
    return {
        "mode": "streams",
        "streams": ns.streams,
        "stream_requests": tally.answers,
        "events": tally.events,
        "errors": tally.errors + sum(s.tally.errors for s in sets[1:]),
        "events_per_s": tally.events / elapsed,
        **_latencies(tally.ttfe, "ttfe_"),
        **(_latencies(sets[1].tally.ttfe, "baseline_ttfe_") if len(sets) > 1 else {}),
        **_cpu(pids, cpu0, ticks0, elapsed),
    }


def _latencies(values: list[float], prefix: str) -> dict[str, float | None]:
    """p50, p90 and p99 in ms, and how many there were."""
    ordered = sorted(values)
    return {
        f"{prefix}p50_ms": _q(ordered, 0.50),
        f"{prefix}p90_ms": _q(ordered, 0.90),
        f"{prefix}p99_ms": _q(ordered, 0.99),
        f"{prefix}count": len(ordered),
    }


def _cpu(pids: list[int], cpu0: int, ticks0: float, window: float) -> dict[str, float]:
    """The proxy's CPU over the window, both ways, and the window's length."""
    return {
        "window_s": window,
        "proxy_cpu_s": (cpu_ns(pids) - cpu0) / 1e9 if pids else 0.0,
        "proxy_cpu_ticks_s": cpu_seconds(pids) - ticks0 if pids else 0.0,
    }


def _q(values: list[float], q: float) -> float | None:
    """The q-quantile of sorted seconds, in ms."""
    if not values:
        return None
    if len(values) == 1:
        return round(values[0] * 1000, 4)
    return round(statistics.quantiles(values, n=1000, method="inclusive")[round(q * 1000) - 1] * 1000, 4)


def main() -> int:
    """Parse arguments, run, print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    req = sub.add_parser("requests")
    req.add_argument("--rate", type=float, default=400.0, help="requests per second")
    req.add_argument("--connections", type=int, default=48)
    req.add_argument("--max-tokens", type=int, default=8)
    req.add_argument("--prompt-bytes", type=int, default=0, help="a long prompt of this many bytes")
    st = sub.add_parser("streams")
    st.add_argument("--streams", type=int, default=100)
    st.add_argument("--max-tokens", type=int, default=200)
    st.add_argument("--stream-rate", type=float, default=100.0, help="the engine's tokens/s per stream")
    req.add_argument(
        "--baseline-rate", type=float, default=0.0, help="requests/s to --baseline-url meanwhile"
    )
    req.add_argument("--baseline-connections", type=int, default=12)
    st.add_argument("--baseline-streams", type=int, default=0, help="streams to --baseline-url meanwhile")
    st.add_argument(
        "--baseline-max-tokens",
        type=int,
        default=0,
        help="their length (0: --max-tokens): short ones, more starts",
    )
    for p in (req, st):
        p.add_argument("--url", required=True)
        p.add_argument(
            "--baseline-url",
            default="",
            help="the engine itself: its latencies, taken meanwhile, are the baseline",
        )
        p.add_argument("--seconds", type=float, default=5.0)
        p.add_argument("--cpu-pids", default="", help="comma-separated pids whose CPU to read")
        p.add_argument(
            "--fifo-priority",
            type=int,
            default=0,
            help="run under SCHED_FIFO at this priority (root): above the simulator's, so that the "
            "clocks are read when the answers come",
        )
    ns = parser.parse_args()
    if ns.fifo_priority:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(ns.fifo_priority))
    pids = [int(p) for p in ns.cpu_pids.split(",") if p]
    run = run_requests if ns.mode == "requests" else run_streams
    print(json.dumps(uvloop.run(run(ns, pids))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
