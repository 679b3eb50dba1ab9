"""Where a process's CPU goes below Python: Linux `perf` samples by shared object and native symbol.

py-spy names Python functions but shows the event loop's C code, the system calls and every C
extension as self time of whichever Python frame ran them. `perf record -e cpu-clock` samples
the machine code instead: the interpreter itself (`python3.11`, or `libpython3.11.so` in a
shared build), the kernel (system calls, and the scheduler waking the process), uvloop,
httptools, orjson... On a paced load that split says what kind of work is left to cut:
bytecode (fewer or cheaper Python calls, or compiled code), or system calls and wake-ups.

perf here samples a clock (`cpu-clock`), not hardware counters: a virtual machine often has
none. No call graphs: a sample names the shared object and the function it ran.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Sample", "find_perf", "parse_report", "record", "report", "summarize"]

# What a shared object is, by its file name: the parts of the table.
_PARTS = (
    (re.compile(r"^(python3|libpython3)"), "the interpreter"),
    (re.compile(r"^\[kernel"), "the kernel"),
    (re.compile(r"^loop\.cpython"), "uvloop (and libuv)"),
    (re.compile(r"^parser\.cpython"), "httptools (llhttp)"),
    (re.compile(r"^(libc\.|libm\.|ld-linux)"), "libc"),
)
_OTHER = "other C extensions and libraries"
# A line of `perf report -t '|' --sort dso,sym`: ` 25.69% |python3.11   |[.] _PyEval_EvalFrameDefault`.
_LINE = re.compile(r"^\s*([\d.]+)%\s*\|\s*(\S.*?)\s*\|\[(.)\]\s*(.*?)\s*$")


@dataclass(frozen=True)
class Sample:
    """One row of perf's report: a share of the samples spent in one function of one shared object."""

    share: float  # 0..1
    dso: str
    symbol: str  # a name, or an address where the object has no symbol for it


def find_perf() -> str | None:
    """The perf binary (linux-perf), or None."""
    return shutil.which("perf")


def record(perf: str, pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    """Start sampling `pid` for `seconds` at ~5 kHz into `out`; wait for the returned process."""
    return subprocess.Popen(
        [
            perf,
            "record",
            "-e",
            "cpu-clock",
            "-F",
            "4999",
            "-p",
            str(pid),
            "-o",
            str(out),
            "--",
            "sleep",
            f"{seconds:g}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def report(perf: str, data: Path) -> str:
    """perf's flat report of `data`, by shared object and symbol, '|'-separated."""
    return subprocess.run(
        [
            perf,
            "report",
            "-i",
            str(data),
            "--no-children",
            "--sort",
            "dso,sym",
            "--stdio",
            "-g",
            "none",
            "-t",
            "|",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout


def parse_report(text: str) -> list[Sample]:
    """The rows of a report made by `report()`; comment lines and blanks skipped."""
    rows = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is not None:
            share, dso, _, symbol = match.groups()
            rows.append(Sample(float(share) / 100, dso, symbol))
    return rows


def part_of(dso: str) -> str:
    """Which part of the table a shared object belongs to."""
    for pattern, part in _PARTS:
        if pattern.search(dso):
            return part
    return _OTHER


def summarize(rows: list[Sample], us_per_unit: float, top: int, unit: str = "request") -> str:
    """Tables: the CPU by part (interpreter, kernel, ...), by shared object, and the hottest functions."""
    if not rows:
        return "no samples (is perf allowed here? /proc/sys/kernel/perf_event_paranoid)"
    total = sum(row.share for row in rows)
    digits = 0 if us_per_unit >= 100 else 2
    parts: dict[str, float] = collections.defaultdict(float)
    dsos: dict[str, float] = collections.defaultdict(float)
    for row in rows:
        parts[part_of(row.dso)] += row.share
        dsos[row.dso] += row.share
    lines = [f"a share of 100 % is {us_per_unit:.{digits}f} µs per {unit}", ""]
    for title, counter in (("part", parts), ("shared object", dsos)):
        lines += [f"| {title} | share | µs/{unit} |", "|---|---:|---:|"]
        for name, share in sorted(counter.items(), key=lambda item: -item[1])[:top]:
            lines.append(
                f"| {name} | {share / total * 100:.1f} % | {share / total * us_per_unit:.{digits}f} |"
            )
        lines.append("")
    lines += [f"| function | shared object | share | µs/{unit} |", "|---|---|---:|---:|"]
    for row in sorted(rows, key=lambda r: -r.share)[:top]:
        share = row.share / total
        lines.append(
            f"| `{row.symbol}` | {row.dso} | {share * 100:.1f} % | {share * us_per_unit:.{digits}f} |"
        )
    return "\n".join(lines) + "\n"
