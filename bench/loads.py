"""The two load generators: wrk (non-streaming POSTs) and bench/sse_load.py (streams), run as child processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["WRK_SCRIPT", "run_sse", "run_wrk"]

HERE = Path(__file__).resolve().parent

# 16 completion tokens, as small as a real request gets: the proxy's per-request cost dominates.
WRK_SCRIPT = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"sim-model","messages":[{"role":"user","content":"Benchmark prompt: say something short."}],"max_tokens":16}'
"""

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text: str) -> float:
    """A wrk duration such as `2.31ms` in milliseconds."""
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise ValueError(f"unexpected wrk duration {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def run_wrk(
    wrk: str, pin: list[str], script: Path, url: str, concurrency: int, seconds: float
) -> dict[str, float]:
    """Run wrk for `seconds` at `concurrency` connections; requests/s, latency percentiles, errors."""
    argv = [
        *pin,
        wrk,
        "-t1",
        f"-c{concurrency}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(script),
        url + "/v1/chat/completions",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=seconds + 60).stdout
    result: dict[str, float] = {"errors": 0.0}
    for pct, value in re.findall(r"^\s+(50|75|90|99)%\s+(\S+)\s*$", out, re.M):
        result[f"p{pct}_ms"] = _ms(value)
    if (m := re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)) is not None:
        result["requests"] = float(m.group(1))
    if (m := re.search(r"Requests/sec:\s+([\d.]+)", out)) is not None:
        result["rps"] = float(m.group(1))
    if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", out)) is not None:
        result["errors"] += float(m.group(1))
    if (
        m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    ) is not None:
        result["errors"] += sum(float(g) for g in m.groups())
    if "rps" not in result or "p50_ms" not in result:
        raise RuntimeError(f"could not read wrk's output:\n{out}")
    return result


def run_sse(pin: list[str], url: str, concurrency: int, seconds: float, max_tokens: int) -> dict[str, float]:
    """Run the SSE load generator; events/s, time to first event, inter-event gap p99, errors."""
    argv = [
        *pin,
        sys.executable,
        str(HERE / "sse_load.py"),
        "--url",
        url,
        "--concurrency",
        str(concurrency),
        "--seconds",
        str(seconds),
        "--max-tokens",
        str(max_tokens),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=seconds + 90).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result
