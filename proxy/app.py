"""Builds the aiohttp application: one setup per concern, in the order their lifetimes nest."""

from __future__ import annotations

from aiohttp import web

from proxy.admin.cases import handle_case_close
from proxy.admin.middleware import ROUTE_POLICY, Handler, setup_admin
from proxy.admin.views import handle_evidence, handle_reset, handle_state
from proxy.admission import ADMISSION, setup_admission
from proxy.body_budget import BODY_BUDGET, setup_body_budget
from proxy.cluster.fanout import setup_cluster
from proxy.config import SETTINGS, Settings
from proxy.engine_state import ENGINE, redetector, setup_engine_state
from proxy.evidence.log import EVIDENCE, setup_evidence
from proxy.forward.engine_exchange import setup_forward
from proxy.health import HEALTH, healthy, ready, setup_health
from proxy.inbound import CONNECTIONS, Limit, setup_connections
from proxy.inbound.aiohttp import forward
from proxy.inbound.setup import setup_front
from proxy.metrics import METRICS, SidecarState, handle_metrics, setup_metrics
from proxy.recorder import setup_recorder
from proxy.refusals import REFUSALS, RefusalReason
from proxy.reset.service import setup_reset
from proxy.upstream.pools import setup_upstream_pool
from proxy.witnesses.kv_events.discovery import setup_kv_discovery
from proxy.witnesses.kv_events.index import setup_kv_events

__all__ = ["build_app", "setup_routes", "sidecar_state"]


def build_app(settings: Settings) -> web.Application:
    """The sidecar application for `settings`.

    Each `setup_<concern>` puts its object on the app under the key its module owns and,
    when the object has a lifetime, registers one `cleanup_ctx` generator. aiohttp starts
    those in list order and stops them in reverse, so the order below IS the start and
    shutdown order:

      0. connections     — the client-connection guard, in front of every request (no lifetime);
      1. evidence        — started first, closed last: every record written at shutdown lands;
      2. upstream pool   — open before anything calls the engine, closed after all of them;
      3. engine state    — detects the engine through the pool;
      4. health          — probes the health path the detected dialect names (handed the
                           engine state's readers: health stands below it);
      5. admission       — the drain gate, and the request-body budget (no lifetime);
      6. metrics         — learns model ids at start; its background fetches stop first
                           (handed `sidecar_state`: metrics stands below what it reports);
      6b. kv events      — the engine's KV cache event subscribers (kv_events_endpoint only),
                           their index handed to the recorder;
      7. recorder        — witness + fan-out to evidence, metrics and the index (no lifetime);
      8. reset service   — stopped before the pool and evidence close: a reset in progress
                           finishes within the grace period (`serve` starts it for requests
                           and resets alike), else is recorded `interrupted by shutdown`;
      9. cluster         — the pool toward peer sidecars (cluster-scope resets);
     10. admin, routes   — the route policy (handed aiohttp's forwarding handler), forwarding's
                           memory, then the routes (each policed);
     11. front           — plain inference requests served beside aiohttp on every client
                           connection (proxy/inbound/; no lifetime).

    In-flight requests and streams finish (up to `grace_period`, waited by `serve`) before any
    of these stop: the runner runs cleanup_ctx after the handlers (docs/architecture.md).

    TCP_NODELAY needs no code here: the event loop (asyncio's and uvloop's alike) sets it on
    every TCP connection it accepts or opens, the clients' and the leg's to the engine.
    """
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    setup_connections(app)
    setup_evidence(app)
    setup_upstream_pool(app)
    setup_engine_state(app)
    engine = app[ENGINE]
    setup_health(app, path=lambda: engine.health_path, on_up=redetector(app))
    setup_admission(app)
    setup_body_budget(app)
    setup_metrics(
        app,
        state=lambda: sidecar_state(app),
        engine_kind=lambda: engine.info.kind,
        engine_mode=lambda: engine.info.mode,
    )
    # The engine's KV cache events (with kv_events_endpoint): bound at start, closed after the reset service.
    index = setup_kv_events(app, app[EVIDENCE].write, app[METRICS].registry)
    # Without kv_events_endpoint: the publishers the engine names (kv_events_discovery).
    setup_kv_discovery(app, index, kind=lambda: engine.info.kind)
    setup_recorder(app, index)
    setup_reset(app)
    setup_cluster(app)
    setup_admin(app, forward)
    setup_forward(app)
    setup_routes(app)
    setup_front(app)
    return app


def setup_routes(app: web.Application) -> None:
    """The sidecar's own routes, then everything else to the engine; each behind the route policy."""
    police = app[ROUTE_POLICY]
    routes: list[tuple[str, str, Handler]] = [
        ("GET", "/-/healthy", healthy),
        ("GET", "/-/ready", ready),
        ("GET", "/metrics", handle_metrics),
        ("POST", "/cache/reset", handle_reset),
        ("GET", "/cache/state", handle_state),
        ("POST", "/cache/cases/{case_id}/close", handle_case_close),
        ("GET", "/cache/evidence", handle_evidence),
        ("*", "/{tail:.*}", forward),
    ]
    for method, path, handler in routes:
        if method == "GET":
            app.router.add_get(path, police(handler, path))  # HEAD too, as aiohttp's add_get does
        else:
            app.router.add_route(method, path, police(handler, path))


def sidecar_state(app: web.Application) -> SidecarState:
    """The services' gauges and counters, read for one scrape (metrics imports none of them)."""
    admission, engine, evidence = app[ADMISSION], app[ENGINE], app[EVIDENCE]
    connections, budget, refusals = app[CONNECTIONS], app[BODY_BUDGET], app[REFUSALS]
    return SidecarState(
        inflight_requests=admission.inflight,
        draining=admission.draining,
        upstream_up=app[HEALTH].upstream_up,
        engine_kind=engine.info.kind,
        engine_version=engine.info.version,
        evidence_records=evidence.records_total,  # a copy, summed over both files
        buffered_request_bytes=budget.held,
        unobserved_total=budget.unobserved_total,
        client_connections=connections.open_connections,
        client_connections_receiving_body=connections.receiving_bodies(),
        connection_limit_hits={str(limit): connections.hits[limit] for limit in Limit},
        route_refusals={str(reason): refusals.counts[reason] for reason in RefusalReason},
        evidence_write_errors_total=evidence.write_errors_total,
        evidence_dropped={str(reason): count for reason, count in evidence.dropped.items()},
        evidence_pending_bytes=evidence.pending_bytes,
    )
