"""Named functions of a running sidecar timed in place: `bench/profile.py --sampler timers`.

    python bench/stage_timer.py --time proxy.forward.exchange:Exchange.observation,... --out F -- serve ...

Starts `cachewitness` with the arguments after `--`, each named function wrapped first so that
every call adds its wall time (`time.perf_counter_ns`) to its total; the wrapper itself costs
~0.35 µs a call (warm, timeit), counted in the sidecar's CPU and in any timed stage around
it. SIGUSR1 zeroes the totals (after a warm-up); SIGUSR2 writes them to `--out` as JSON
(`{name: [calls, ns]}`). Times are inclusive: a function timed inside another counts in both.

Why wall time: pinned alone on its core (and under SCHED_FIFO, `--realtime`, nothing else
runs there meanwhile), a sidecar's synchronous code runs on the CPU from its first line to
its last, so the wall time of a call is its CPU time, as the sidecar ran it under load (cold,
at a paced rate), which neither a sampler at a few kHz (too few samples per call of a few µs)
nor an A/B of lesions (±3-5 % noise per round) resolves (issue 34). A function run in another
thread (the evidence writer's) also counts the time it waits for the GIL: an upper bound.

A name is `module:qualname`: a function of the module, or a method of one of its classes.
A module-level function is also replaced in every module that imported it by name. Coroutine
functions are refused: their wall time would include every await.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_STAGES", "Window", "install", "names", "resolve", "summarize"]

# What a finished request's recording is made of (proxy/forward/engine_exchange.py, proxy/recorder.py),
# and the evidence flush that writes it.
DEFAULT_STAGES = (
    "proxy.forward.engine_exchange:record_finished",
    "proxy.forward.exchange:Exchange.forwarded",
    "proxy.forward.exchange:Exchange.observation",
    "proxy.observe.json_body:JsonBody.read",
    "proxy.witnesses.case:CaseWitness.observed",
    "proxy.witnesses.traffic:Witness.observe",
    "proxy.evidence.log:EvidenceLog.write_later",
    "proxy.metrics.families:Metrics.finished",
    "proxy.evidence.writer:EvidenceWriter._built",
    "proxy.evidence.writer:EvidenceWriter._chain_and_write",
    "proxy.forward.engine_exchange:prepare",
    "proxy.forward.relay:start_observing",
)


class _Totals:
    """Calls and nanoseconds per name; the writer's thread adds to them too, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, list[int]] = {}  # name: [calls, ns]

    def add(self, name: str, ns: int) -> None:
        with self._lock:
            total = self._totals.setdefault(name, [0, 0])
            total[0] += 1
            total[1] += ns

    def reset(self) -> None:
        with self._lock:
            self._totals.clear()

    def snapshot(self) -> dict[str, list[int]]:
        with self._lock:
            return {name: list(total) for name, total in self._totals.items()}


def _timed(name: str, function: Callable[..., Any], totals: _Totals) -> Callable[..., Any]:
    clock = time.perf_counter_ns

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return function(*args, **kwargs)
        finally:
            totals.add(name, clock() - start)

    timed.__wrapped__ = function  # type: ignore[attr-defined]
    return timed


def names(text: str) -> list[str]:
    """The names `--time` gives (comma-separated, empty ones skipped)."""
    return [name for name in text.split(",") if name]


def resolve(name: str) -> tuple[Any, str, Callable[..., Any]]:
    """The function `module:qualname` names: (its owner, a module or class; its attribute; it).

    Raises ValueError when the name is not one of a plain function or method.
    """
    module_name, _, qualname = name.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
        *path, attribute = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{name}: {exc}") from None
    function = inspect.getattr_static(owner, attribute, None)
    if not inspect.isfunction(function):
        raise ValueError(f"{name}: not a plain function or method")
    if inspect.iscoroutinefunction(function):
        raise ValueError(f"{name}: a coroutine function; its wall time would count its awaits")
    return owner, attribute, function


def install(names: list[str], totals: _Totals) -> None:
    """Wrap each named function where it is looked up (ValueError for a name that is not one)."""
    for name in names:
        owner, attribute, function = resolve(name)
        timed = _timed(name, function, totals)
        setattr(owner, attribute, timed)
        if inspect.ismodule(owner):  # `from module import function` elsewhere bound the original
            for other in list(sys.modules.values()):
                if other is not None and getattr(other, attribute, None) is function:
                    setattr(other, attribute, timed)


class Window:
    """The measured window of a sidecar started by this module: opened now (SIGUSR1), closed by
    `wait()`, which has it write its totals (SIGUSR2) and waits for the file."""

    def __init__(self, pid: int, out: Path) -> None:
        self._pid, self._out = pid, out
        out.unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR1)

    def wait(self, timeout: float) -> None:
        os.kill(self._pid, signal.SIGUSR2)
        deadline = time.monotonic() + timeout
        while not self._out.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the sidecar wrote no timers to {self._out}")
            time.sleep(0.05)


def summarize(totals: dict[str, list[int]], count: float, cpu_us: float, unit: str) -> str:
    """A table: each timed function's calls per `unit`, µs per call, µs per unit, share of the CPU."""
    lines = [
        f"| function | calls per {unit} | µs per call | µs per {unit} | of the CPU per {unit} |",
        "|---|---:|---:|---:|---:|",
    ]
    units = max(1.0, count)
    for name, (calls, ns) in sorted(totals.items(), key=lambda item: -item[1][1]):
        per = ns / 1000 / units
        share = f"{100 * per / cpu_us:.1f} %" if cpu_us else "—"
        lines.append(f"| `{name}` | {calls / units:.2f} | {ns / 1000 / calls:.1f} | {per:.1f} | {share} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time", default=",".join(DEFAULT_STAGES), help="comma-separated module:qualname")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("cachewitness", nargs=argparse.REMAINDER, help="-- and cachewitness' own arguments")
    ns = parser.parse_args()
    argv = ns.cachewitness[1:] if ns.cachewitness[:1] == ["--"] else ns.cachewitness
    sys.path.insert(0, os.getcwd())  # the checkout run from, as `python -m proxy` finds it
    import proxy.serve  # noqa: F401  (every module the server runs, imported before the wrapping)
    from proxy.cli import main as cachewitness

    totals = _Totals()
    install(names(ns.time), totals)
    signal.signal(signal.SIGUSR1, lambda *_: totals.reset())
    signal.signal(signal.SIGUSR2, lambda *_: ns.out.write_text(json.dumps(totals.snapshot())))
    return cachewitness(argv)


if __name__ == "__main__":
    raise SystemExit(main())
