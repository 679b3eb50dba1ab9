"""Observing inference answers: usage read out, `include_usage` injected and its traces removed.

Nothing here does I/O. The forwarding handler calls `prepare_request` on the request
body, feeds an SSE answer through a `StreamScanner` (with the engine's `StreamRules`
when it injected) or a JSON response through a `JsonBody`, and builds an `Observation`.

    sse.py       SSE framing: bytes in, events and their data out
    jsonscan.py  the one JSON byte scanner (members, value ends, byte-wise removal)
    usage.py     token counts from an object, a body or a fragment
    answer.py    a JSON answer in bounded memory
    rules.py     each engine's stream facts under injection, as a table
    pending_finish.py  the pending finish chunk: last-event members moved back
    stream.py    the stream scanner that applies them
    request.py   observed routes and the injected request body
    record.py    the Observation record
"""

from proxy.observe.json_body import JsonBody
from proxy.observe.record import Observation
from proxy.observe.request import (
    INJECTABLE_PATHS,
    OBSERVED_PATHS,
    PreparedRequest,
    is_observed,
    names_stream_options,
    prepare_request,
)
from proxy.observe.rules import STREAM_RULES, InjectionRefusals, StreamRules, rules_for
from proxy.observe.sse import MAX_EVENT_BYTES
from proxy.observe.stream import StreamScanner, decode_count
from proxy.observe.usage import Usage, usage_from_json

__all__ = [
    "INJECTABLE_PATHS",
    "MAX_EVENT_BYTES",
    "OBSERVED_PATHS",
    "STREAM_RULES",
    "InjectionRefusals",
    "JsonBody",
    "Observation",
    "PreparedRequest",
    "StreamRules",
    "StreamScanner",
    "Usage",
    "decode_count",
    "is_observed",
    "names_stream_options",
    "prepare_request",
    "rules_for",
    "usage_from_json",
]
