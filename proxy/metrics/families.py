"""The sidecar's own families and the hot-path calls that move them (no I/O, no locks)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from proxy.config import Settings
from proxy.metrics.hot import Alias, HotCollector, HotCounter, HotFamily, HotHistogram, Kind
from proxy.metrics.labels import (
    _CLASS_OF,
    ADDED_BUCKETS,
    CACHED_TOKEN_BUCKETS,
    CODES,
    ENGINE_LABELS,
    LATENCY_BUCKETS,
    OTHER,
    OVERHEAD_BUCKETS,
    PREFIX,
    RESET_ANSWERS,
    RESET_ATTEMPT_BUCKETS,
    RESET_DURATION_BUCKETS,
    ROUTES,
    UPSTREAM_ERROR_KINDS,
    VERDICTS,
)
from proxy.metrics.models import ModelLabels
from proxy.observe import Observation
from proxy.observe.record import Forwarded
from proxy.vocabulary import CanaryOutcome, EngineKind, IsolationResult, Outcome, ServedBy, Verified


@dataclass(frozen=True, slots=True)
class _ModelSeries:
    """The per-model children, looked up once per label instead of once per request."""

    prompt: HotCounter
    cached: HotCounter
    without_cached: HotCounter
    cached_per_request: HotHistogram


@dataclass(frozen=True, slots=True)
class _RouteSeries:
    """The per-route histogram children."""

    duration: HotHistogram
    ttfb: HotHistogram


# Finished requests wait for their series in batches of this many, and every read of the
# series (a scrape) moves those waiting first. At a deployment's rate one request comes per
# wake-up and ran this code cold; a batch runs it warm (bench/README.md, issue 34).
_BATCH = 64

# `kind` of cachewitness_engine_events_total (the `infer.engine_event` kinds).
ENGINE_EVENT_KINDS = ("restarted", "slept", "woke", "unreachable", "back")
# A request's results (a case's `empty` is no request's); pre-created at 0 for the alert.
ISOLATED_RESULTS: tuple[IsolationResult, ...] = tuple(
    result for result in IsolationResult if result is not IsolationResult.EMPTY
)


class Metrics:
    """The sidecar's metric definitions and the hot-path calls that move them (no I/O, no locks of ours)."""

    def __init__(self, settings: Settings) -> None:
        """Define every family on a private registry and pre-create its bounded label sets."""
        self.registry = CollectorRegistry()
        self.models = ModelLabels(settings.metrics_models, settings.metrics_max_models)
        # Called (cheaply) from the hot path while the model ids are not known yet.
        self.on_unknown_models: Callable[[], None] | None = None
        # Requests finished whose series have not moved yet (`settle`), oldest first.
        self._waiting: list[tuple[Forwarded, Observation | None, str | None]] = []
        registry = self.registry
        # The families every request moves, without prometheus_client's locks (proxy/metrics/hot.py);
        # registered first, so the exposition keeps its order.
        self.requests = HotFamily(
            PREFIX + "requests_total",
            "Forwarded requests by route, response status class and the server that took them.",
            ("route", "code", "served_by"),
            Kind.COUNTER,
        )
        self.request_duration = HotFamily(
            PREFIX + "request_duration_seconds",
            "Forwarded request time, request in to last byte out.",
            ("route",),
            Kind.HISTOGRAM,
            LATENCY_BUCKETS,
        )
        self.ttfb = HotFamily(
            PREFIX + "time_to_first_byte_seconds",
            "Request in to the response head sent to the client.",
            ("route",),
            Kind.HISTOGRAM,
            LATENCY_BUCKETS,
        )
        self.overhead = HotFamily(
            PREFIX + "sidecar_overhead_seconds",
            "Time the sidecar itself spent: request in to upstream request sent (phase=request), "
            "upstream response head to client response head (phase=response).",
            ("phase",),
            Kind.HISTOGRAM,
            OVERHEAD_BUCKETS,
        )
        self.added = HotFamily(
            PREFIX + "added_seconds",
            "Time the sidecar added to a request: its last byte read to its last byte written to the "
            "engine (direction=in); the engine's first answer byte read to the first byte written to "
            "the client, a stream's first event (direction=out).",
            ("direction",),
            Kind.HISTOGRAM,
            ADDED_BUCKETS,
        )
        self.upstream_errors = HotFamily(
            PREFIX + "upstream_errors_total",
            "Forwarded requests the engine failed, by kind.",
            ("kind",),
            Kind.COUNTER,
        )
        self.prompt_tokens = HotFamily(
            PREFIX + "prompt_tokens_total",
            "Prompt tokens the engine reported, by model.",
            ("model",),
            Kind.COUNTER,
        )
        self.cached_tokens = HotFamily(
            PREFIX + "cached_tokens_total",
            "Prompt tokens the engine reported served from its prefix cache.",
            ("model",),
            Kind.COUNTER,
        )
        self.responses_without_cached_tokens = HotFamily(
            PREFIX + "responses_without_cached_tokens_total",
            "Completed 2xx inference responses whose usage had no cached-token field, by model.",
            ("model",),
            Kind.COUNTER,
        )
        self.request_cached_tokens = HotFamily(
            PREFIX + "request_cached_tokens",
            "Cached prompt tokens per inference request (where reported).",
            ("model",),
            Kind.HISTOGRAM,
            CACHED_TOKEN_BUCKETS,
        )
        registry.register(
            HotCollector(
                (
                    self.requests,
                    self.request_duration,
                    self.ttfb,
                    self.overhead,
                    self.added,
                    self.upstream_errors,
                    self.prompt_tokens,
                    self.cached_tokens,
                    self.responses_without_cached_tokens,
                    self.request_cached_tokens,
                ),
                # The family's first name counted responses but read as tokens; kept one release
                # (docs/operations.md, "Deprecated metrics").
                (
                    Alias(
                        self.responses_without_cached_tokens,
                        PREFIX + "cached_tokens_unknown_total",
                        "Deprecated: the same counter as cachewitness_responses_without_cached_tokens_total "
                        "(responses, not tokens); removed in the next release.",
                    ),
                ),
            )
        )
        self.verifications = Counter(
            PREFIX + "cache_verifications_total",
            "Traffic verdicts of accepted resets: what the requests after a reset showed.",
            ("verdict",),
            registry=registry,
        )
        self.canary_requests = Counter(
            PREFIX + "canary_requests_total",
            "Canary requests sent to verify resets (not client traffic), by outcome.",
            ("outcome",),
            registry=registry,
        )
        self.bypass_requests = Counter(
            PREFIX + "bypass_requests_total",
            "Requests the engine's own counters show that did not pass through the sidecar.",
            registry=registry,
        )
        self.engine_events = Counter(
            PREFIX + "engine_events_total",
            "Engine events seen: restarted, slept, woke, unreachable, back.",
            ("kind",),
            registry=registry,
        )
        self.isolated_requests = Counter(
            PREFIX + "isolated_requests_total",
            "Isolated requests by what their answer proved: cold (0 cached tokens), contradicted (the engine "
            "ignored the isolation), unobservable (no cached-token field), refused (could not be isolated, never ran).",
            ("result",),
            registry=registry,
        )
        self.resets_verified = Counter(
            PREFIX + "cache_resets_verified_total",
            "Cache resets by what their canary proved (unverified: no canary, or it could not tell).",
            ("verified",),
            registry=registry,
        )
        self.resets = Counter(
            PREFIX + "cache_resets_total",
            "Cache resets run against the engine, by engine kind and the answer the caller got "
            "(contradicted: the engine acknowledged, a witness proved the cache still warm; "
            "coalesced calls count once).",
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
            (route, code, server): self.requests.counter(route, code, server.value)
            for route in ROUTES
            for code in CODES
            for server in ServedBy
        }
        self._routes = {
            route: _RouteSeries(self.request_duration.histogram(route), self.ttfb.histogram(route))
            for route in ROUTES
        }
        self._overhead_request = self.overhead.histogram("request")
        self._overhead_response = self.overhead.histogram("response")
        self._added_in = self.added.histogram("in")
        self._added_out = self.added.histogram("out")
        self._upstream_errors = {kind: self.upstream_errors.counter(kind) for kind in UPSTREAM_ERROR_KINDS}
        self._verdicts = {verdict: self.verifications.labels(verdict) for verdict in VERDICTS}
        self._canary = {outcome: self.canary_requests.labels(outcome.value) for outcome in CanaryOutcome}
        self._verified = {verified: self.resets_verified.labels(verified.value) for verified in Verified}
        self._isolated: dict[IsolationResult, Counter] = {
            result: self.isolated_requests.labels(result.value) for result in ISOLATED_RESULTS
        }
        for kind in ENGINE_EVENT_KINDS:  # pre-created at 0: alerts see a series from the start
            self.engine_events.labels(kind)
        # Created per engine kind as it is detected (show_engine), not for every kind there is.
        self._resets: dict[tuple[str, str], Counter] = {}
        self._models: dict[str, _ModelSeries] = {}
        for model in (*self.models.ids, OTHER):
            self._model_series(model)

    def _model_series(self, label: str) -> _ModelSeries:
        """The children of one model label, created on first use (labels are bounded by ModelLabels)."""
        series = self._models.get(label)
        if series is None:
            series = _ModelSeries(
                self.prompt_tokens.counter(label),
                self.cached_tokens.counter(label),
                self.responses_without_cached_tokens.counter(label),
                self.request_cached_tokens.histogram(label),
            )
            self._models[label] = series
        return series

    def learn_models(self, listed: Iterable[str]) -> None:
        """Allow the engine's listed model ids as labels (bounded), showing zeros for new ones at once."""
        for model in self.models.learn(listed):
            self._model_series(model)

    def finished(self, f: Forwarded, observation: Observation | None, verdict: str | None) -> None:
        """Everything one finished request moves, in one call: its transport facts, then its tokens.

        They move in the next batch (`settle`), before anything reads them.
        """
        if observation is not None and not self.models.known and self.on_unknown_models is not None:
            self.on_unknown_models()
        waiting = self._waiting
        waiting.append((f, observation, verdict))
        if len(waiting) >= _BATCH:
            self.settle()

    def settle(self) -> None:
        """Move the series of every finished request still waiting, in the order they finished."""
        waiting, self._waiting = self._waiting, []
        for f, observation, verdict in waiting:
            self._forwarded(f)
            if observation is not None:
                self._observed(observation, verdict)

    def _forwarded(self, f: Forwarded) -> None:
        """Count one forwarded exchange: requests, duration, TTFB, overhead, added time, upstream errors."""
        route = f.path if f.path in self._routes else OTHER
        code = _CLASS_OF.get(f.status, "none") if f.status is not None else "none"
        self._requests[(route, code, f.served_by)].inc()
        series = self._routes[route]
        series.duration.observe(max(0.0, (f.finished_ns - f.started_ns) / 1e9))
        if f.first_byte_ns is not None:
            series.ttfb.observe(max(0.0, (f.first_byte_ns - f.started_ns) / 1e9))
        if f.before_upstream_s is not None:
            self._overhead_request.observe(max(0.0, f.before_upstream_s))
        if f.after_upstream_s is not None:
            self._overhead_response.observe(max(0.0, f.after_upstream_s))
        if f.added_in_us is not None:
            self._added_in.observe(f.added_in_us / 1e6)
        if f.added_out_us is not None:
            self._added_out.observe(f.added_out_us / 1e6)
        if f.outcome != Outcome.OK:
            kind = _upstream_error_kind(f)
            if kind is not None:
                self._upstream_errors[kind].inc()

    def _observed(self, observation: Observation, verdict: str | None) -> None:
        """Count one inference request's tokens by model, and a verdict when it settled one."""
        series = self._model_series(self.models.label(observation.model))
        prompt, cached = observation.prompt_tokens, observation.cached_tokens
        if prompt is not None and prompt >= 0:
            series.prompt.inc(prompt)
        if cached is not None and cached >= 0:
            series.cached.inc(cached)
            series.cached_per_request.observe(cached)
        elif (
            cached is None
            and observation.outcome == Outcome.OK
            and observation.status is not None
            and 200 <= observation.status < 300
        ):
            series.without_cached.inc()
        if verdict is not None:
            counter = self._verdicts.get(verdict)
            if counter is not None:
                counter.inc()

    def show_engine(self, engine_kind: str) -> None:
        """Show zeros for every answer of a detected engine kind (the reset alerts' series exist before
        the first reset); a kind not detected yet gets none."""
        if engine_kind == EngineKind.UNKNOWN or (engine_kind, RESET_ANSWERS[0]) in self._resets:
            return
        for answer in RESET_ANSWERS:
            self._reset_counter(engine_kind, answer)

    def _reset_counter(self, engine_kind: str, answer: str) -> Counter:
        """The child of one (engine, answer): at most |ENGINE_LABELS ∪ other| x |RESET_ANSWERS ∪ other|."""
        engine = engine_kind if engine_kind in ENGINE_LABELS else OTHER
        answer = answer if answer in RESET_ANSWERS else OTHER
        counter = self._resets.get((engine, answer))
        if counter is None:
            counter = self._resets[(engine, answer)] = self.resets.labels(engine, answer)
        return counter

    def reset_answered(self, engine_kind: str, answer: str, duration_s: float, attempts: int) -> None:
        """Count one answered POST /cache/reset under the answer its caller got."""
        self._reset_counter(engine_kind, answer).inc()
        self.reset_duration.observe(max(0.0, duration_s))
        self.reset_attempts.observe(max(0, attempts))

    def bypass(self, requests: int) -> None:
        """Count requests that reached the engine around the sidecar."""
        self.bypass_requests.inc(requests)

    def engine_event(self, kind: str) -> None:
        """Count one engine event."""
        self.engine_events.labels(kind).inc()

    def isolated(self, result: IsolationResult) -> None:
        """Count one isolated request by its result."""
        self._isolated[result].inc()

    def canary_request(self, outcome: CanaryOutcome) -> None:
        """Count one canary request."""
        self._canary[outcome].inc()

    def reset_verified(self, verified: Verified) -> None:
        """Count one engine reset by what its canary proved."""
        self._verified[verified].inc()

    def exposition(self, engine_metrics_up: bool) -> bytes:
        """The sidecar's own text, with `upstream_metrics_up` saying what this very scrape merged."""
        self.settle()
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


def _upstream_error_kind(f: Forwarded) -> str | None:
    """Which kind of upstream failure an exchange was, if any."""
    if f.outcome == Outcome.TIMEOUT:
        return "timeout"
    if f.outcome == Outcome.UPSTREAM_ERROR:
        if f.bad_answer:
            return "bad_answer"
        return "broken_response" if f.first_byte_ns is not None else "connection"
    if f.outcome == Outcome.OK and f.status is not None and f.status >= 500:
        return "engine_5xx"
    return None
