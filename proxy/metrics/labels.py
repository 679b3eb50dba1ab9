"""The metric families' names, label sets and buckets: each closed set of words written once."""

from __future__ import annotations

from proxy.observe import OBSERVED_PATHS
from proxy.vocabulary import EngineKind, EventType, ResetAnswer, Verdict

PREFIX = "cachewitness_"
OTHER = "other"
# The text format every Prometheus server reads; the merge asks the engine for the same.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bounded label values. `route` is the path when it is one of these, else "other".
ROUTES: tuple[str, ...] = (*sorted(OBSERVED_PATHS), "/v1/models", OTHER)
# `code` is the status class; "none" when no response head reached the client (it left first).
CODES: tuple[str, ...] = ("2xx", "3xx", "4xx", "5xx", "none")
_CLASS_OF = {status: f"{status // 100}xx" for status in range(200, 600)}
# `engine` of cache_resets_total: every kind the sidecar knows, "unknown" included.
ENGINE_LABELS: tuple[str, ...] = tuple(EngineKind)
# `answer` of cache_resets_total: the answer the caller got, so a reset the engine acknowledged
# and a witness contradicted counts as `contradicted`, never as `acknowledged`.
RESET_ANSWERS: tuple[str, ...] = tuple(
    str(answer) for answer in ResetAnswer if answer is not ResetAnswer.PARTIAL
)
# The traffic verdicts a reset settles on (`pending` is no settlement).
VERDICTS: tuple[str, ...] = tuple(verdict.value for verdict in Verdict if verdict is not Verdict.PENDING)
# The records a pod writes (the cluster read's trailer is never written).
EVENT_TYPES: tuple[str, ...] = tuple(str(kind) for kind in EventType if kind is not EventType.CLUSTER_READ)
# connection: no answer head (refused, reset, DNS); broken_response: the engine broke a response
# it had started; timeout: no byte within read_timeout; engine_5xx: the engine answered >= 500;
# bad_answer: an answer that is not HTTP, past the leg's head limits, or not relayable unchanged.
UPSTREAM_ERROR_KINDS: tuple[str, ...] = (
    "connection",
    "broken_response",
    "timeout",
    "engine_5xx",
    "bad_answer",
)
PHASES: tuple[str, ...] = ("request", "response")

# LLM requests range from a cached 5 ms answer to minutes-long generations.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
# Le "0" counts the cold answers on its own: the bucket a benchmark's first request must land in.
CACHED_TOKEN_BUCKETS = (0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0)
# The sidecar's own time per request: tens of microseconds when all is well.
# The sidecar's added time per request (cachewitness_added_seconds): a paced request adds tens of
# microseconds each way, a burst or a large body milliseconds. 1-1.5-2-3-5-7.5 a decade from 10 µs
# to 10 ms: a p50 read from them (histogram_quantile) is within a few µs where it matters.
ADDED_BUCKETS = (
    *(
        round(step * 10.0**exponent, 9)
        for exponent in (-5, -4, -3)
        for step in (1.0, 1.5, 2.0, 3.0, 5.0, 7.5)
    ),
    0.01,
    0.1,
)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Retries (≤ 120 s) + the last attempt (reset_attempt_timeout), with room for a drain if counted in.
RESET_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RESET_ATTEMPT_BUCKETS = (1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0, 250.0)
