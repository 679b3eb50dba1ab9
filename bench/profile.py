"""Where the sidecar's CPU goes per request: py-spy on one sidecar under load, as tables.

    .venv/bin/pip install -e '.[bench]'      # py-spy, pinned in pyproject's bench extra
    .venv/bin/python bench/profile.py [--load wrk|paced|streams] [--seconds 8] [--bare] [--top 25]
    .venv/bin/python bench/profile.py --load wrk [--concurrency 16]
    .venv/bin/python bench/profile.py --load paced [--rate 400] [--connections 48] [--prompt-bytes 220000]
    .venv/bin/python bench/profile.py --load streams [--streams 100]
    .venv/bin/python bench/profile.py --load paced --rate 100 --sampler perf --sidecar-python /usr/bin/python3.11

Starts the vLLM simulator and one sidecar (defaults: evidence and injection on; `--bare`:
`--no-observe --no-inject-usage`), each pinned as in `make bench`, and samples the sidecar
with `py-spy record --format raw` while a load runs:

- `wrk` (the default): the simulator at decode rate 0, wrk's small non-streaming chat
  completions at `--concurrency`: the sidecar saturated;
- `paced`: the paced bench's request case (bench/paced.py): the simulator at 100 tokens/s,
  `--rate` requests/s offered open-loop over `--connections` keep-alive connections, 8 tokens
  each: where a deployment's per-request CPU goes, much of it per wakeup (`--prompt-bytes`:
  the paced bench's large prompt, e.g. `--rate 20 --connections 8 --prompt-bytes 220000`);
- `streams`: the paced bench's stream case: `--streams` connections running streams of 200
  tokens back to back, paced by the engine: the CPU per SSE event.

Prints the sidecar's CPU µs per request (per SSE event for `streams`) over the run, then the
functions with the largest inclusive and self shares of the samples, with the µs per request
(event) each share stands for. uvloop's own work (its C code and the system calls it makes)
shows as self time of `Runner.run` (py-spy's `--native` would name it, but must pause the
sidecar at every sample, which queues the paced load). `--raw FILE` keeps py-spy's collapsed stacks (feed them to a flame graph tool).

`--sampler perf` samples the machine code instead (Linux perf, bench/native_profile.py): the CPU
by part — the interpreter, the kernel, uvloop, httptools, libc, other extensions — by shared
object, and the hottest native functions. That names what py-spy folds into `Runner.run`: the
kernel's share, and within it the scheduler waking the process, against the bytecode's.
`--sidecar-python` runs the sidecar on another interpreter, as `bench/paced.py`'s.

`--sampler timers` samples nothing: named functions of the sidecar are timed in place, every
call (bench/stage_timer.py; `--time module:qualname,...`, by default the stages of a finished
request's recording and the evidence flush). It prints each one's calls, µs per call and µs
per request beside the sidecar's CPU per request: what a stage of a few µs costs as the
sidecar runs it, which the samplers see too rarely and an A/B of lesions cannot resolve.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import native_profile
import stage_timer
from harness import RT_LOADGEN_PRIORITY, Cores, Service, cpu_seconds, ensure_tools, realtime, start_simulator
from interpreters import describe, sidecar_python
from loads import WRK_SCRIPT, run_wrk
from paths import BARE, start_sidecar

HERE = Path(__file__).resolve().parent

_IDLE = ("epoll", "select", "_run_once (asyncio", "poll (selectors")


def _frames(stack: str) -> list[str]:
    """One collapsed stack (`a;b;c`) as frames, outermost first, in `function (file)` form."""
    frames = []
    for frame in stack.split(";"):
        name, _, where = frame.partition(" (")
        path = where.rsplit(":", 1)[0].rstrip(")")
        frames.append(f"{name} ({_short(path)})")
    return frames


def _short(path: str) -> str:
    """A source path from its package on (`aiohttp/client.py`, `proxy/inbound/aiohttp.py`)."""
    for marker in ("site-packages/", "/proxy/", "python3."):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return ("proxy/" + tail) if marker == "/proxy/" else tail.split("/", 1)[-1]
    return path


def summarize(raw: str, top: int, us_per_request: float, unit: str = "request") -> str:
    """Inclusive and self tables from py-spy's raw (collapsed) output."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = _frames(stack)
        if frames and any(mark in frames[-1] for mark in _IDLE):
            continue  # waiting for the next event is not work done for a request
        total += count
        for frame in set(frames):
            inclusive[frame] += count
        if frames:
            own[frames[-1]] += count
    if not total:
        return "no busy samples"
    digits = 0 if us_per_request >= 100 else 2
    lines = [f"{total} busy samples; a share of 100 % is {us_per_request:.{digits}f} µs per {unit}", ""]
    for title, counter in (("inclusive", inclusive), ("self", own)):
        lines += [f"| {title} share | µs/{unit} | function |", "|---:|---:|---|"]
        for frame, count in counter.most_common(top):
            share = count / total
            lines.append(f"| {share * 100:.1f} % | {share * us_per_request:.{digits}f} | `{frame}` |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    """Run the load, sample the sidecar, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", choices=("wrk", "paced", "streams"), default="wrk")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=16, help="wrk's connections (--load wrk)")
    parser.add_argument("--rate", type=float, default=400.0, help="requests/s offered (--load paced)")
    parser.add_argument("--connections", type=int, default=48, help="keep-alive connections (--load paced)")
    parser.add_argument(
        "--prompt-bytes",
        type=int,
        default=0,
        help="a long prompt of this many bytes (--load paced; 0: short)",
    )
    parser.add_argument("--streams", type=int, default=100, help="concurrent streams (--load streams)")
    parser.add_argument("--bare", action="store_true", help="--no-observe --no-inject-usage")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sample-rate", type=int, default=500, help="py-spy samples per second")
    parser.add_argument("--raw", type=Path, help="also keep py-spy's collapsed stacks here")
    parser.add_argument(
        "--sampler",
        choices=("py-spy", "perf", "timers"),
        default="py-spy",
        help="py-spy: Python functions; perf: machine code, by shared object (the interpreter, the "
        "kernel, uvloop...) and native function (bench/native_profile.py); timers: named functions "
        "timed in place (bench/stage_timer.py)",
    )
    parser.add_argument(
        "--time",
        default=",".join(stage_timer.DEFAULT_STAGES),
        help="--sampler timers: the functions, comma-separated module:qualname",
    )
    parser.add_argument(
        "--sidecar-python",
        help="the interpreter the sidecar runs on (default: this one; bench/interpreters.py)",
    )
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="run everything started under SCHED_FIFO (root): on a machine shared with other work "
        "each process then runs when woken, as on a dedicated core",
    )
    ns = parser.parse_args()
    sampler = _sampler(ns.sampler)
    if ns.sampler == "timers":
        for name in stage_timer.names(ns.time):
            try:
                stage_timer.resolve(name)
            except ValueError as exc:
                sys.exit(f"bench/profile.py --time: {exc}")
    python = sidecar_python(ns.sidecar_python)
    wrk = ensure_tools()[1] if ns.load == "wrk" else ""
    if ns.realtime:  # after any install
        realtime()
    cores = Cores.choose(pin=True)
    with tempfile.TemporaryDirectory(prefix="cw-profile-") as tmp:
        work = Path(tmp)
        sim = start_simulator(cores.rest, work, decode_rate=0 if ns.load == "wrk" else 100)
        timers = work / "timers.json"
        timed = (str(HERE / "stage_timer.py"), "--time", ns.time, "--out", str(timers), "--")
        sidecar = start_sidecar(
            "sidecar",
            sim.url,
            BARE if ns.bare else [],
            cores.proxy,
            work,
            python=python,
            entry=timed if ns.sampler == "timers" else None,
        )
        raw_path = work / "profile.txt"
        try:
            _load(ns, wrk, cores, work, sidecar, 1.0)  # warm-up
            sampling: subprocess.Popen[bytes] | stage_timer.Window
            if ns.sampler == "timers":
                sampling = stage_timer.Window(sidecar.proc.pid, timers)
            elif ns.sampler == "perf":
                sampling = native_profile.record(sampler, sidecar.proc.pid, ns.seconds, work / "perf.data")
            else:
                sampling = _py_spy_record(sampler, sidecar.proc.pid, ns.seconds, ns.sample_rate, raw_path)
            spent, count, figure = _load(ns, wrk, cores, work, sidecar, ns.seconds)
            sampling.wait(timeout=ns.seconds + 60)
        finally:
            sidecar.stop()
            sim.stop()
        if ns.sampler == "perf":
            raw = native_profile.report(sampler, work / "perf.data")
        elif ns.sampler == "timers":
            raw = timers.read_text()
        else:
            raw = raw_path.read_text() if raw_path.exists() else ""
        if ns.raw is not None:
            ns.raw.write_text(raw)
    us = 1e6 * spent / max(1.0, count)
    unit = "event" if ns.load == "streams" else "request"
    kind = "bare" if ns.bare else "evidence + injection on"
    how = {
        "perf": "perf, cpu-clock at 4,999 Hz,",
        "timers": "the timers, ~0.35 µs a timed call,",
    }.get(ns.sampler, f"py-spy --nonblocking at {ns.sample_rate} Hz")
    print(
        f"sidecar ({kind}) on {describe(python)}, {figure} for {ns.seconds:g} s: "
        f"CPU {us:.{0 if us >= 100 else 2}f} µs per {unit} ({how} adds a little)\n"
    )
    if ns.sampler == "perf":
        print(native_profile.summarize(native_profile.parse_report(raw), us, ns.top, unit))
    elif ns.sampler == "timers":
        print(stage_timer.summarize(json.loads(raw), count, us, unit))
    else:
        print(summarize(raw, ns.top, us, unit))
    return 0


def _py_spy_record(py_spy: str, pid: int, seconds: float, rate: int, out: Path) -> subprocess.Popen[bytes]:
    """Start py-spy sampling `pid` for `seconds` into `out` (collapsed stacks); wait for the returned process."""
    return subprocess.Popen(
        [
            *(py_spy, "record", "--pid", str(pid), "--duration", str(round(seconds))),
            *("--rate", str(rate), "--format", "raw", "--output", str(out), "--nonblocking"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _sampler(kind: str) -> str:
    """The sampler's binary, or exit saying how to install it ("" for the timers, which need none)."""
    if kind == "timers":
        return ""
    if kind == "perf":
        perf = native_profile.find_perf()
        if perf is None:
            sys.exit("bench/profile.py --sampler perf needs perf: apt-get install -y linux-perf")
        return perf
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        sys.exit("bench/profile.py needs py-spy: .venv/bin/pip install -e '.[bench]'")
    return py_spy


def _load(
    ns: argparse.Namespace, wrk: str, cores: Cores, work: Path, sidecar: Service, seconds: float
) -> tuple[float, float, str]:
    """Run the chosen load for `seconds`: the sidecar's CPU seconds, requests (events), and what ran."""
    if ns.load == "wrk":
        script = work / "post.lua"
        script.write_text(WRK_SCRIPT)
        before = cpu_seconds(sidecar.pids())
        result = run_wrk(wrk, Cores.prefix(cores.rest), script, sidecar.url, ns.concurrency, seconds)
        spent = cpu_seconds(sidecar.pids()) - before
        return spent, result["requests"], f"wrk c={ns.concurrency}: {result['rps']:.0f} req/s"
    if ns.load == "paced":
        argv = [
            "requests",
            "--rate",
            f"{ns.rate:g}",
            "--connections",
            str(ns.connections),
            "--max-tokens",
            "8",
            *(("--prompt-bytes", str(ns.prompt_bytes)) if ns.prompt_bytes else ()),
        ]
    else:
        argv = ["streams", "--streams", str(ns.streams), "--max-tokens", "200"]
    pids = ",".join(map(str, sidecar.pids()))
    command = [
        *Cores.prefix(cores.rest),
        *(sys.executable, str(HERE / "paced_load.py"), *argv),
        *("--url", sidecar.url, "--seconds", f"{seconds:g}", "--cpu-pids", pids),
        *(("--fifo-priority", str(RT_LOADGEN_PRIORITY)) if ns.realtime else ()),
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=seconds + 120).stdout
    r = json.loads(out.strip().splitlines()[-1])
    if ns.load == "paced":
        what = f"{ns.rate:g} requests/s over {ns.connections} connections ({r['queued']} queued)"
        return r["proxy_cpu_s"], r["requests"], what
    return r["proxy_cpu_s"], r["events"], f"{ns.streams} paced streams ({r['events_per_s']:.0f} events/s)"


if __name__ == "__main__":
    raise SystemExit(main())
