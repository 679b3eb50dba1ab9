"""Prometheus metrics on a private registry, and `GET /metrics` merged with the engine's own (SPEC §7).

The sidecar's families all start with `cachewitness_` and live on their own
`CollectorRegistry`: the engine's exposition already carries `process_*`/`python_*`
families, and a second copy in the merged text would collide. The merge itself is
istio-agent's: the sidecar's text, then the engine's text, fetched on demand.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.admission import ADMISSION
from proxy.config import SETTINGS, Settings
from proxy.engine_state import ENGINE
from proxy.engines.base import OUTCOMES
from proxy.evidence import EVIDENCE
from proxy.exchange import Forwarded
from proxy.health import HEALTH
from proxy.observe import OBSERVED_PATHS
from proxy.pool import UPSTREAM_POOL
from proxy.shared_fetch import SharedFetch

if TYPE_CHECKING:
    from proxy.observe import Observation

__all__ = [
    "CODES",
    "CONTENT_TYPE",
    "ENGINE_LABELS",
    "ENGINE_TEXT",
    "METRICS",
    "OTHER",
    "ROUTES",
    "UPSTREAM_ERROR_KINDS",
    "VERDICTS",
    "Metrics",
    "ModelLabels",
    "engine_exposition",
    "handle_metrics",
    "setup_metrics",
]

PREFIX = "cachewitness_"
OTHER = "other"
# The text format every Prometheus server reads; the merge asks the engine for the same.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_ENGINE_ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
_EXPOSITION_TYPES = frozenset({"text/plain", "application/openmetrics-text"})

# Bounded label values. `route` is the path when it is one of these, else "other".
ROUTES: tuple[str, ...] = (*sorted(OBSERVED_PATHS), "/v1/models", OTHER)
# `code` is the status class; "none" when no response head reached the client (it left first).
CODES: tuple[str, ...] = ("2xx", "3xx", "4xx", "5xx", "none")
_CLASS_OF = {status: f"{status // 100}xx" for status in range(200, 600)}
# `engine` of cache_resets_total: the kinds the sidecar can detect or be told (config.ENGINE_KINDS
# less "auto"), plus "unknown" while `--engine auto` has not reached the upstream.
ENGINE_LABELS: tuple[str, ...] = ("vllm", "sglang", "llamacpp", "mindnano", "generic", "none", "unknown")
VERDICTS: tuple[str, ...] = ("consistent", "contradicted", "unobservable")
EVENT_TYPES: tuple[str, ...] = ("infer.cache_state", "infer.cache_observation", "infer.cache_verification")
# connection: no answer head (refused, reset, DNS); broken_response: the engine broke a response
# it had started; timeout: no byte within read_timeout; engine_5xx: the engine answered >= 500.
UPSTREAM_ERROR_KINDS: tuple[str, ...] = ("connection", "broken_response", "timeout", "engine_5xx")
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
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Retries (≤ 120 s) + the last attempt (reset_attempt_timeout), with room for a drain if counted in.
RESET_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RESET_ATTEMPT_BUCKETS = (1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0, 250.0)

_ENGINE_METRICS_LIMIT = 32 * 1024 * 1024  # a vLLM exposition with many LoRA/histograms is a few MiB
_MODELS_LIMIT = 1024 * 1024
_MODEL_ID_MAX = 256
_VERSION_MAX = 64
# The engine's model list is learnt again this often (a LoRA adapter may have been loaded). While it
# is not known yet (the engine was down when the sidecar started) every scrape retries, and the hot
# path starts a background retry at most this often.
MODELS_REFRESH_S = 60.0
MODELS_RETRY_S = 5.0
# Concurrent scrapes share one engine fetch, and its text serves scrapes for this long after it
# (several Prometheus replicas and dashboards must not multiply the engine's /metrics work).
ENGINE_METRICS_MAX_AGE_S = 1.0
ENGINE_TEXT = web.AppKey("engine_text", SharedFetch)


class ModelLabels:
    """Maps a request's `model` to a bounded label value: an allowed id, else `other`.

    The allowed ids are `metrics_models` when configured; otherwise the ids the engine
    lists at `/v1/models`, at most `metrics_max_models` of them over the process's
    whole life, so a label never takes request-controlled text and never grows unbounded.
    """

    def __init__(self, allow: tuple[str, ...], max_models: int) -> None:
        """Start from the configured allow-list (empty: learn the engine's ids)."""
        self.configured = bool(allow)
        self._ids: dict[str, str] = {name: name for name in allow}
        self._max = max_models
        self.refreshed_at = -math.inf  # monotonic time of the last successful listing
        self.tried_at = -math.inf

    @property
    def known(self) -> bool:
        """Whether the allowed ids are settled: configured, or listed by the engine once."""
        return self.configured or self.refreshed_at > -math.inf

    @property
    def ids(self) -> tuple[str, ...]:
        """The allowed ids, in the order they were learnt."""
        return tuple(self._ids)

    def label(self, model: str | None) -> str:
        """The label for a request's model; a request without one on a one-model engine is that model."""
        if model is None:
            return next(iter(self._ids)) if len(self._ids) == 1 else OTHER
        return self._ids.get(model, OTHER)

    def learn(self, listed: Iterable[str]) -> list[str]:
        """Add the engine's listed ids while room is left; return those that are new."""
        added: list[str] = []
        for model in listed:
            if len(self._ids) >= self._max:
                break
            if model not in self._ids:
                self._ids[model] = model
                added.append(model)
        self.refreshed_at = time.monotonic()
        return added

    def due(self, now: float, retry_s: float) -> bool:
        """Whether the engine's list should be fetched now: retried after `retry_s` while unknown."""
        if self.configured:
            return False
        if not self.known:
            return now - self.tried_at >= retry_s
        return now - self.refreshed_at >= MODELS_REFRESH_S


@dataclass(frozen=True, slots=True)
class _ModelSeries:
    """The per-model children, looked up once per label instead of once per request."""

    prompt: Any
    cached: Any
    unknown: Any
    cached_per_request: Any


@dataclass(frozen=True, slots=True)
class _RouteSeries:
    """The per-route histogram children."""

    duration: Any
    ttfb: Any


class Metrics:
    """The sidecar's metric definitions and the hot-path calls that move them (no I/O, no locks of ours)."""

    def __init__(self, settings: Settings) -> None:
        """Define every family on a private registry and pre-create its bounded label sets."""
        self.registry = CollectorRegistry()
        self.models = ModelLabels(settings.metrics_models, settings.metrics_max_models)
        # Called (cheaply) from the hot path while the model ids are not known yet.
        self.on_unknown_models: Callable[[], None] | None = None
        registry = self.registry
        self.requests = Counter(
            PREFIX + "requests_total",
            "Forwarded requests by route and response status class.",
            ("route", "code"),
            registry=registry,
        )
        self.request_duration = Histogram(
            PREFIX + "request_duration_seconds",
            "Forwarded request time, request in to last byte out.",
            ("route",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttfb = Histogram(
            PREFIX + "time_to_first_byte_seconds",
            "Request in to the response head sent to the client.",
            ("route",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.overhead = Histogram(
            PREFIX + "sidecar_overhead_seconds",
            "Time the sidecar itself spent: request in to upstream request sent (phase=request), "
            "upstream response head to client response head (phase=response).",
            ("phase",),
            buckets=OVERHEAD_BUCKETS,
            registry=registry,
        )
        self.upstream_errors = Counter(
            PREFIX + "upstream_errors_total",
            "Forwarded requests the engine failed, by kind.",
            ("kind",),
            registry=registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens_total",
            "Prompt tokens the engine reported, by model.",
            ("model",),
            registry=registry,
        )
        self.cached_tokens = Counter(
            PREFIX + "cached_tokens_total",
            "Prompt tokens the engine reported served from its prefix cache.",
            ("model",),
            registry=registry,
        )
        self.cached_tokens_unknown = Counter(
            PREFIX + "cached_tokens_unknown_total",
            "Completed 2xx inference responses with no cached-token field.",
            ("model",),
            registry=registry,
        )
        self.request_cached_tokens = Histogram(
            PREFIX + "request_cached_tokens",
            "Cached prompt tokens per inference request (where reported).",
            ("model",),
            buckets=CACHED_TOKEN_BUCKETS,
            registry=registry,
        )
        self.verifications = Counter(
            PREFIX + "cache_verifications_total",
            "Verdicts of accepted resets (SPEC §5.3).",
            ("verdict",),
            registry=registry,
        )
        self.resets = Counter(
            PREFIX + "cache_resets_total",
            "Cache resets run against the engine, by engine kind and answer (coalesced calls count once).",
            ("engine", "answer"),
            registry=registry,
        )
        self.reset_duration = Histogram(
            PREFIX + "cache_reset_duration_seconds",
            "Time of one cache reset against the engine, retries included.",
            buckets=RESET_DURATION_BUCKETS,
            registry=registry,
        )
        self.reset_attempts = Histogram(
            PREFIX + "cache_reset_attempts",
            "Engine reset attempts per cache reset.",
            buckets=RESET_ATTEMPT_BUCKETS,
            registry=registry,
        )

        self._requests = {
            (route, code): self.requests.labels(route, code) for route in ROUTES for code in CODES
        }
        self._routes = {
            route: _RouteSeries(self.request_duration.labels(route), self.ttfb.labels(route))
            for route in ROUTES
        }
        self._overhead_request = self.overhead.labels("request")
        self._overhead_response = self.overhead.labels("response")
        self._upstream_errors = {kind: self.upstream_errors.labels(kind) for kind in UPSTREAM_ERROR_KINDS}
        self._verdicts = {verdict: self.verifications.labels(verdict) for verdict in VERDICTS}
        self._resets = {
            (engine, answer): self.resets.labels(engine, answer)
            for engine in ENGINE_LABELS
            for answer in OUTCOMES
        }
        self._models: dict[str, _ModelSeries] = {}
        for model in (*self.models.ids, OTHER):
            self._model_series(model)

    def _model_series(self, label: str) -> _ModelSeries:
        """The children of one model label, created on first use (labels are bounded by ModelLabels)."""
        series = self._models.get(label)
        if series is None:
            series = _ModelSeries(
                self.prompt_tokens.labels(label),
                self.cached_tokens.labels(label),
                self.cached_tokens_unknown.labels(label),
                self.request_cached_tokens.labels(label),
            )
            self._models[label] = series
        return series

    def learn_models(self, listed: Iterable[str]) -> None:
        """Allow the engine's listed model ids as labels (bounded), showing zeros for new ones at once."""
        for model in self.models.learn(listed):
            self._model_series(model)

    def forwarded(self, f: Forwarded) -> None:
        """Count one forwarded exchange: requests, duration, TTFB, overhead, upstream errors."""
        route = f.path if f.path in self._routes else OTHER
        code = _CLASS_OF.get(f.status, "none") if f.status is not None else "none"
        self._requests[(route, code)].inc()
        series = self._routes[route]
        series.duration.observe(max(0.0, (f.finished_ns - f.started_ns) / 1e9))
        if f.first_byte_ns is not None:
            series.ttfb.observe(max(0.0, (f.first_byte_ns - f.started_ns) / 1e9))
        if f.before_upstream_s is not None:
            self._overhead_request.observe(max(0.0, f.before_upstream_s))
        if f.after_upstream_s is not None:
            self._overhead_response.observe(max(0.0, f.after_upstream_s))
        kind = _upstream_error_kind(f)
        if kind is not None:
            self._upstream_errors[kind].inc()

    def observe(self, observation: Observation, verification: dict[str, Any] | None) -> None:
        """Count one inference request's tokens by model, and a verdict when it settled one."""
        if not self.models.known and self.on_unknown_models is not None:
            self.on_unknown_models()
        series = self._model_series(self.models.label(observation.model))
        prompt, cached = observation.prompt_tokens, observation.cached_tokens
        if prompt is not None and prompt >= 0:
            series.prompt.inc(prompt)
        if cached is not None and cached >= 0:
            series.cached.inc(cached)
            series.cached_per_request.observe(cached)
        elif (
            cached is None
            and observation.outcome == "ok"
            and observation.status is not None
            and 200 <= observation.status < 300
        ):
            series.unknown.inc()
        if verification is not None:
            counter = self._verdicts.get(str(verification.get("verdict")))
            if counter is not None:
                counter.inc()

    def reset_answered(self, engine_kind: str, answer: str, duration_s: float, attempts: int) -> None:
        """Count one answered POST /cache/reset."""
        engine = engine_kind if engine_kind in ENGINE_LABELS else OTHER
        answer = answer if answer in OUTCOMES else OTHER
        counter = self._resets.get((engine, answer))
        if counter is None:  # at most |ENGINE_LABELS ∪ other| x |OUTCOMES ∪ other| children
            counter = self._resets[(engine, answer)] = self.resets.labels(engine, answer)
        counter.inc()
        self.reset_duration.observe(max(0.0, duration_s))
        self.reset_attempts.observe(max(0, attempts))

    def exposition(self, engine_metrics_up: bool) -> bytes:
        """The sidecar's own text, with `upstream_metrics_up` saying what this very scrape merged."""
        # Written per scrape, not kept in the registry: two concurrent scrapes must not see
        # each other's answer.
        return (
            generate_latest(self.registry)
            + (
                f"# HELP {PREFIX}upstream_metrics_up 1 when the engine's /metrics was merged into this scrape, else 0.\n"
                f"# TYPE {PREFIX}upstream_metrics_up gauge\n"
                f"{PREFIX}upstream_metrics_up {1.0 if engine_metrics_up else 0.0}\n"
            ).encode()
        )


METRICS = web.AppKey("metrics", Metrics)


def _upstream_error_kind(f: Forwarded) -> str | None:
    """Which kind of upstream failure an exchange was, if any."""
    if f.outcome == "timeout":
        return "timeout"
    if f.outcome == "upstream_error":
        return "broken_response" if f.first_byte_ns is not None else "connection"
    if f.outcome == "ok" and f.status is not None and f.status >= 500:
        return "engine_5xx"
    return None


class _StateCollector(Collector):
    """Gauges and counters read at scrape time from their owners, so each count is the owner's own."""

    def __init__(self, app: web.Application) -> None:
        """Read from the app's shared objects (looked up at each scrape)."""
        self._app = app

    def collect(self) -> Iterator[Metric]:
        """Yield in-flight, draining, upstream_up, engine_info and the evidence writer's counters."""
        app = self._app
        admission, health, engine, evidence = app[ADMISSION], app[HEALTH], app[ENGINE], app[EVIDENCE]
        yield GaugeMetricFamily(
            PREFIX + "inflight_requests",
            "Forwarded requests admitted and not finished.",
            value=admission.inflight,
        )
        yield GaugeMetricFamily(
            PREFIX + "draining",
            "1 while a cache reset holds new requests.",
            value=1 if admission.draining else 0,
        )
        yield GaugeMetricFamily(
            PREFIX + "upstream_up",
            "1 when the engine answered its health probe recently.",
            value=1 if health.upstream_up else 0,
        )
        info = GaugeMetricFamily(
            PREFIX + "engine_info", "The engine behind the sidecar (always 1).", labels=("kind", "version")
        )
        info.add_metric((engine.info.kind, (engine.info.version or "")[:_VERSION_MAX]), 1)
        yield info
        records = CounterMetricFamily(
            PREFIX + "evidence_records_total",
            "Evidence records written, by event type.",
            labels=("event_type",),
        )
        # A copy: the writer's thread adds keys (dict() copies atomically under the GIL).
        written = dict(evidence.records_total)
        for event_type in sorted(set(EVENT_TYPES) | set(written)):
            records.add_metric((event_type,), written.get(event_type, 0))
        yield records
        yield CounterMetricFamily(
            PREFIX + "evidence_write_errors_total",
            "Evidence writes the disk refused.",
            value=evidence.write_errors_total,
        )
        yield CounterMetricFamily(
            PREFIX + "evidence_dropped_total",
            "Evidence records that will never be written.",
            value=evidence.dropped_total,
        )

    def describe(self) -> Iterator[Metric]:
        """Nothing to describe up front (the registry checks names only of families it is told)."""
        return iter(())


def engine_exposition(body: bytes) -> bytes:
    """The engine's text, made safe to append to ours.

    Drops OpenMetrics' `# EOF` (it must end the whole exposition, which ours does not) and
    `# UNIT` lines, and any family named like ours (two `# TYPE` lines for one name make
    Prometheus reject the whole scrape).
    """
    if b"# EOF" in body or b"# UNIT" in body or PREFIX.encode() in body:
        kept = [line for line in body.splitlines() if not _foreign_line(line)]
        body = b"\n".join(kept)
    if body and not body.endswith(b"\n"):
        body += b"\n"
    return body


def _foreign_line(line: bytes) -> bool:
    """Whether a line of the engine's text must not reach the merged exposition."""
    stripped = line.strip()
    if stripped == b"# EOF" or stripped.startswith(b"# UNIT "):
        return True
    if stripped.startswith((b"# HELP ", b"# TYPE ")):
        return stripped[7:].lstrip().startswith(PREFIX.encode())
    return stripped.startswith(PREFIX.encode())


async def _read_limited(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` bytes."""
    parts: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


async def fetch_engine_metrics(session: aiohttp.ClientSession, base: str, timeout_s: float) -> bytes | None:
    """The engine's `/metrics` text, or None when it has none (non-200), is down, or is too slow."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Accept": _ENGINE_ACCEPT, "Accept-Encoding": "identity"}
    try:
        async with session.get(
            base + "/metrics", headers=headers, timeout=timeout, allow_redirects=False
        ) as response:
            # The pool does not decompress (auto_decompress=False): only identity text can be merged. An
            # OpenAI-compatible server that answers every path with its web UI must not be merged either.
            if (
                response.status != 200
                or response.content_type not in _EXPOSITION_TYPES
                or response.headers.get("Content-Encoding", "identity") != "identity"
            ):
                return None
            body = await _read_limited(response, _ENGINE_METRICS_LIMIT)
    except (TimeoutError, aiohttp.ClientError, OSError, RuntimeError):
        # RuntimeError: the pool closed under a scrape during shutdown.
        return None
    return engine_exposition(body) if body is not None else None


async def fetch_model_ids(session: aiohttp.ClientSession, base: str, timeout_s: float) -> list[str] | None:
    """The model ids the engine lists at `/v1/models` (OpenAI shape), or None when it cannot say."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(
            base + "/v1/models",
            headers={"Accept": "application/json"},
            timeout=timeout,
            allow_redirects=False,
        ) as response:
            if response.status != 200:
                return None
            body = await _read_limited(response, _MODELS_LIMIT)
    except (TimeoutError, aiohttp.ClientError, OSError, RuntimeError):
        return None
    try:
        data = orjson.loads(body) if body is not None else None
    except orjson.JSONDecodeError:
        return None
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return None
    return [
        entry["id"]
        for entry in entries
        if isinstance(entry, dict)
        and isinstance(entry.get("id"), str)
        and 0 < len(entry["id"]) <= _MODEL_ID_MAX
    ]


async def refresh_models(app: web.Application) -> None:
    """Learn the engine's model ids (when no allow-list is configured). Never raises."""
    metrics = app[METRICS]
    session = app[UPSTREAM_POOL]
    if metrics.models.configured or session.closed:
        return
    settings = app[SETTINGS]
    metrics.models.tried_at = time.monotonic()
    listed = await fetch_model_ids(session, settings.upstream_base, settings.upstream_metrics_timeout)
    if listed is not None:
        metrics.learn_models(listed)


async def handle_metrics(request: web.Request) -> web.Response:
    """GET /metrics: the sidecar's exposition, then the engine's own when it has one."""
    app = request.app
    metrics = app[METRICS]
    session = app[UPSTREAM_POOL]
    engine_text: bytes | None = None
    if not session.closed:
        fetch = app[ENGINE_TEXT].get()
        if metrics.models.due(time.monotonic(), retry_s=0.0):
            engine_text, _ = await asyncio.gather(fetch, refresh_models(app))
        else:
            engine_text = await fetch
    body = metrics.exposition(engine_metrics_up=engine_text is not None) + (engine_text or b"")
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def setup_metrics(app: web.Application) -> Metrics:
    """Create the app's Metrics and learn the engine's model ids at start (`GET /metrics` is in the routes)."""
    # `*_created` series double every counter and histogram for nothing a dashboard uses
    # (vLLM turns them off the same way); process-wide, and the sidecar owns its process.
    disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
    metrics = Metrics(app[SETTINGS])
    metrics.registry.register(_StateCollector(app))
    app[METRICS] = metrics

    async def fetch_engine_text() -> bytes | None:
        """The engine's /metrics through the app's upstream pool (None while it is closed)."""
        session, settings = app[UPSTREAM_POOL], app[SETTINGS]
        if session.closed:
            return None
        return await fetch_engine_metrics(session, settings.upstream_base, settings.upstream_metrics_timeout)

    shared_text: SharedFetch[bytes | None] = SharedFetch(fetch_engine_text, ENGINE_METRICS_MAX_AGE_S)
    app[ENGINE_TEXT] = shared_text
    pending: set[asyncio.Task[None]] = set()
    stopping: list[bool] = []

    def on_unknown_models() -> None:
        """From the hot path: fetch the model ids in the background, one fetch at a time, throttled."""
        if pending or stopping or not metrics.models.due(time.monotonic(), MODELS_RETRY_S):
            return
        metrics.models.tried_at = time.monotonic()
        task = asyncio.get_running_loop().create_task(refresh_models(app))
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        """Learn the model ids once the pool is open; at shutdown, cancel background fetches
        before the pool closes, and start none after."""
        await refresh_models(app)
        yield
        stopping.append(True)
        await shared_text.close()
        for task in list(pending):
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    metrics.on_unknown_models = on_unknown_models
    app.cleanup_ctx.append(lifetime)
    return metrics
