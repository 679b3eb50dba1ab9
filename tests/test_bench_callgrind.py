"""bench/callgrind.py: callgrind_annotate's table read by shared object, and the per-request slope.

On the text callgrind_annotate 3.19 prints (the sample's rows are from a real dump of the sidecar).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.bench_modules import bench_module

ANNOTATED = """\
--------------------------------------------------------------------------------
Profile data file '/tmp/cg.25416.1' (creator: callgrind-3.19.0)
--------------------------------------------------------------------------------
Thresholds:       100
Timerange: Basic block 0 - 19821778
--------------------------------------------------------------------------------
Ir
--------------------------------------------------------------------------------
118,682,383 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                   file:function
--------------------------------------------------------------------------------
32,059,027 (27.01%)  ???:_PyEval_EvalFrameDefault'2 [/usr/bin/python3.11]
11,005,676 ( 9.27%)  ???:0x000000000029ad80 [/usr/lib/x86_64-linux-gnu/libcrypto.so.3]
 9,514,308 ( 8.02%)  ???:_PyEval_EvalFrameDefault [/usr/bin/python3.11]
   702,259 ( 0.59%)  ./string/../memset-vec-unaligned-erms.S:__memset_avx2_unaligned_erms [/usr/lib/x86_64-linux-gnu/libc.so.6]
    50,600 ( 0.04%)  /project/multidict/_multilib/hashtable.h:_md_extend_item
       912 ( 0.00%)  ???:dumps [/venv/lib/python3.11/site-packages/orjson/orjson.cpython-311-x86_64-linux-gnu.so]
"""


def _callgrind() -> Any:
    """bench/callgrind.py, as bench/instructions.py imports it."""
    return bench_module("callgrind")


def test_rows_are_summed_by_shared_object_and_the_totals_row_is_not_one() -> None:
    callgrind = _callgrind()
    assert callgrind.by_object(ANNOTATED) == {
        "python3": 32_059_027 + 9_514_308,
        "libcrypto": 11_005_676,
        "libc": 702_259,
        callgrind.UNNAMED: 50_600,
        "orjson": 912,
    }


def test_a_header_or_a_blank_line_counts_nothing() -> None:
    assert _callgrind().by_object("Ir\n\nThresholds: 100\n118 (1.0%)  PROGRAM TOTALS\n") == {}


def test_the_slope_is_what_the_busier_load_counted_beyond_the_quieter_per_extra_request() -> None:
    per = _callgrind().slope({"python3": 1_000, "libc": 100}, {"python3": 4_000, "orjson": 50}, (40, 160))
    assert per == {"python3": 25.0, "libc": -100 / 120, "orjson": 50 / 120}


def test_a_busier_load_that_answered_no_more_requests_is_refused() -> None:
    with pytest.raises(ValueError, match="no more requests"):
        _callgrind().slope({"python3": 1}, {"python3": 2}, (40, 40))
