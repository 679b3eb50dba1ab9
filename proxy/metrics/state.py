"""Gauges and counters read at scrape time from the services that own them.

metrics stands below the services it reports (admission, health, the engine state, the body
budget, the connection guard, the route refusals, the evidence log), so it imports none of
them: build_app hands `setup_metrics` a reader that takes one `SidecarState` of them per scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.metrics.labels import EVENT_TYPES, PREFIX

__all__ = ["SidecarState", "StateCollector"]

_VERSION_MAX = 64


@dataclass(frozen=True)
class SidecarState:
    """What one scrape reports, each count read from its owner (label values in their order)."""

    inflight_requests: int
    draining: bool
    upstream_up: bool
    engine_kind: str
    engine_version: str | None
    evidence_records: Mapping[str, int]  # written, by event type, over both files
    buffered_request_bytes: int
    unobserved_total: int  # past max_buffered_bytes
    client_connections: int
    client_connections_receiving_body: int
    connection_limit_hits: Mapping[str, int]  # every limit
    route_refusals: Mapping[str, int]  # every refusal reason
    evidence_write_errors_total: int
    evidence_dropped: Mapping[str, int]  # by drop reason
    evidence_pending_bytes: int


class StateCollector(Collector):
    """Gauges and counters read at scrape time from their owners, so each count is the owner's own."""

    def __init__(self, read: Callable[[], SidecarState]) -> None:
        """`read` takes the state at each scrape."""
        self._read = read

    def collect(self) -> Iterator[Metric]:
        """Yield in-flight, draining, upstream_up, engine_info, client connections, the evidence writer's counters."""
        state = self._read()
        yield GaugeMetricFamily(
            PREFIX + "inflight_requests",
            "Forwarded requests admitted and not finished.",
            value=state.inflight_requests,
        )
        yield GaugeMetricFamily(
            PREFIX + "draining",
            "1 while a cache reset holds new requests.",
            value=1 if state.draining else 0,
        )
        yield GaugeMetricFamily(
            PREFIX + "upstream_up",
            "1 when the engine answered its health probe recently.",
            value=1 if state.upstream_up else 0,
        )
        info = GaugeMetricFamily(
            PREFIX + "engine_info", "The engine behind the sidecar (always 1).", labels=("kind", "version")
        )
        info.add_metric((state.engine_kind, (state.engine_version or "")[:_VERSION_MAX]), 1)
        yield info
        records = CounterMetricFamily(
            PREFIX + "evidence_records_total",
            "Evidence records written, by event type.",
            labels=("event_type",),
        )
        written = state.evidence_records
        for event_type in sorted(set(EVENT_TYPES) | set(written)):
            records.add_metric((event_type,), written.get(event_type, 0))
        yield records
        yield GaugeMetricFamily(
            PREFIX + "buffered_request_bytes",
            "Request-body bytes held to be observed (bounded by max_buffered_bytes).",
            value=state.buffered_request_bytes,
        )
        unobserved = CounterMetricFamily(
            PREFIX + "requests_unobserved_total",
            "Inference requests forwarded without an observation, by reason.",
            labels=("reason",),
        )
        unobserved.add_metric(("max_buffered_bytes",), state.unobserved_total)
        yield unobserved
        yield GaugeMetricFamily(
            PREFIX + "client_connections", "Client connections open.", value=state.client_connections
        )
        yield GaugeMetricFamily(
            PREFIX + "client_connections_receiving_body",
            "Client connections whose request body is still arriving (slow uploads hold these).",
            value=state.client_connections_receiving_body,
        )
        hits = CounterMetricFamily(
            PREFIX + "connection_limit_hits_total",
            "Client connections closed by a header or body timeout, or refused by a connection cap.",
            labels=("limit",),
        )
        for limit, count in state.connection_limit_hits.items():
            hits.add_metric((limit,), count)
        yield hits
        refused = CounterMetricFamily(
            PREFIX + "route_refusals_total",
            "Requests the route policy refused: admin auth failed, or a path engines could read differently.",
            labels=("reason",),
        )
        for refusal, count in state.route_refusals.items():
            refused.add_metric((refusal,), count)
        yield refused
        yield CounterMetricFamily(
            PREFIX + "evidence_write_errors_total",
            "Evidence writes the disk refused.",
            value=state.evidence_write_errors_total,
        )
        dropped = CounterMetricFamily(
            PREFIX + "evidence_dropped_total",
            "Evidence records that will never be written, by reason.",
            labels=("reason",),
        )
        for reason, count in state.evidence_dropped.items():
            dropped.add_metric((reason,), count)
        yield dropped
        yield GaugeMetricFamily(
            PREFIX + "evidence_pending_bytes",
            "Evidence bytes waiting for the disk (bounded by evidence_queue_max_bytes).",
            value=state.evidence_pending_bytes,
        )

    def describe(self) -> Iterator[Metric]:
        """Nothing to describe up front (the registry checks names only of families it is told)."""
        return iter(())
