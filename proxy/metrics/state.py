"""Gauges and counters read at scrape time from the objects that own them."""

from __future__ import annotations

from collections.abc import Iterator

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.admission import ADMISSION
from proxy.body_budget import BODY_BUDGET
from proxy.connections import CONNECTIONS, Limit
from proxy.engine_state import ENGINE
from proxy.evidence.log import EVIDENCE
from proxy.health import HEALTH
from proxy.metrics.labels import EVENT_TYPES, PREFIX
from proxy.refusals import REFUSALS, RefusalReason

_VERSION_MAX = 64


class StateCollector(Collector):
    """Gauges and counters read at scrape time from their owners, so each count is the owner's own."""

    def __init__(self, app: web.Application) -> None:
        """Read from the app's shared objects (looked up at each scrape)."""
        self._app = app

    def collect(self) -> Iterator[Metric]:
        """Yield in-flight, draining, upstream_up, engine_info, client connections, the evidence writer's counters."""
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
        written = evidence.records_total  # a copy, summed over both files
        for event_type in sorted(set(EVENT_TYPES) | set(written)):
            records.add_metric((event_type,), written.get(event_type, 0))
        yield records
        budget = app[BODY_BUDGET]
        yield GaugeMetricFamily(
            PREFIX + "buffered_request_bytes",
            "Request-body bytes held to be observed (bounded by max_buffered_bytes).",
            value=budget.held,
        )
        unobserved = CounterMetricFamily(
            PREFIX + "requests_unobserved_total",
            "Inference requests forwarded without an observation, by reason.",
            labels=("reason",),
        )
        unobserved.add_metric(("max_buffered_bytes",), budget.unobserved_total)
        yield unobserved
        connections = app[CONNECTIONS]
        yield GaugeMetricFamily(
            PREFIX + "client_connections", "Client connections open.", value=connections.open_connections
        )
        hits = CounterMetricFamily(
            PREFIX + "connection_limit_hits_total",
            "Client connections closed by header_timeout or body_idle_timeout, or refused by max_connections.",
            labels=("limit",),
        )
        for limit in Limit:
            hits.add_metric((str(limit),), connections.hits[limit])
        yield hits
        refused = CounterMetricFamily(
            PREFIX + "route_refusals_total",
            "Requests the route policy refused: admin auth failed, or a path engines could read differently.",
            labels=("reason",),
        )
        refusals = app[REFUSALS]
        for refusal in RefusalReason:
            refused.add_metric((str(refusal),), refusals.counts[refusal])
        yield refused
        yield CounterMetricFamily(
            PREFIX + "evidence_write_errors_total",
            "Evidence writes the disk refused.",
            value=evidence.write_errors_total,
        )
        dropped = CounterMetricFamily(
            PREFIX + "evidence_dropped_total",
            "Evidence records that will never be written, by reason.",
            labels=("reason",),
        )
        for reason, count in evidence.dropped.items():
            dropped.add_metric((str(reason),), count)
        yield dropped
        yield GaugeMetricFamily(
            PREFIX + "evidence_pending_bytes",
            "Evidence bytes waiting for the disk (bounded by evidence_queue_max_bytes).",
            value=evidence.pending_bytes,
        )

    def describe(self) -> Iterator[Metric]:
        """Nothing to describe up front (the registry checks names only of families it is told)."""
        return iter(())
