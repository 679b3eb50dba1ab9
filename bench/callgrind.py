"""Reading callgrind's counts: callgrind_annotate's self-cost table by shared object, and per request.

Text in, numbers out (no process runs here): bench/instructions.py runs valgrind and hands
each dump's annotated table to `by_object`.
"""

from __future__ import annotations

from pathlib import PurePath

__all__ = ["UNNAMED", "by_object", "object_name", "slope"]


def object_name(path: str) -> str:
    """`python3`, `libcrypto`, `orjson`: a shared object's file name up to its first dot."""
    return PurePath(path).name.split(".", 1)[0]


# Where a row names no object (code inlined from a header of an extension's build tree).
UNNAMED = "(unnamed)"


def _row(line: str) -> tuple[int, str] | None:
    """A self-cost row, `  1,234 (0.50%)  file:function [/path/object.so]`: its count and object
    (UNNAMED without one). The table's header, its PROGRAM TOTALS and anything else: None."""
    count, _, rest = line.strip().partition(" ")
    digits = count.replace(",", "")
    if not digits.isdigit() or rest.endswith("PROGRAM TOTALS"):
        return None
    opened, closed = rest.rfind("["), rest.rfind("]")
    if opened < 0 or closed < opened or rest[closed + 1 :].strip():
        return int(digits), UNNAMED
    return int(digits), object_name(rest[opened + 1 : closed])


def by_object(annotated: str) -> dict[str, int]:
    """The instructions of callgrind_annotate's self-cost table, summed by shared object."""
    sums: dict[str, int] = {}
    for line in annotated.splitlines():
        row = _row(line)
        if row is not None:
            count, name = row
            sums[name] = sums.get(name, 0) + count
    return sums


def slope(low: dict[str, int], high: dict[str, int], requests: tuple[int, int]) -> dict[str, float]:
    """Per request, by object: what the busier window counted beyond the quieter one."""
    extra = requests[1] - requests[0]
    if extra <= 0:
        raise ValueError(f"the second load answered no more requests than the first ({requests})")
    return {name: (high.get(name, 0) - low.get(name, 0)) / extra for name in {*low, *high}}
