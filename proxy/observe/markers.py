"""What the stream scanner looks for in an event's bytes."""

from __future__ import annotations

__all__ = ["FINISH_KEY", "FINISH_NULL", "NULL_TAIL", "SIDE_MARKERS", "USAGE_KEY"]

USAGE_KEY = b'"usage"'
# Markers of the other places counts live (llama.cpp, SGLang /generate, mindnano, SGLang's
# per-tier `sglext` chunk).
SIDE_MARKERS = (b'"timings"', b'"meta_info"', b'"mindnano_metrics"', b'"sglext"')
# How an injected `"usage":null` usually ends a content chunk (compact JSON, usage last).
NULL_TAIL = b',"usage":null}'
FINISH_KEY = b'"finish_reason"'
# A content chunk's finish_reason, compact: the one form a read of many events is checked for.
FINISH_NULL = b'"finish_reason":null'
