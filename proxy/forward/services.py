"""What a forwarded exchange uses of the app, looked up once when the app starts rather than per request.

An aiohttp `app[KEY]` is a Python call (`Application.__getitem__`), and the exchange made nine to
twelve of them per request (bench/calls.py, issue 50). The objects behind the keys live as
long as the app, so one record, made at startup once the upstream leg exists, serves every
request: each server's `ClientSide` carries it.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from proxy.admission import ADMISSION, Admission
from proxy.body_budget import BODY_BUDGET, BodyBudget
from proxy.config import SETTINGS, Settings
from proxy.engine_state import ENGINE, EngineState
from proxy.forward.injection_probe import INJECTION_PROBE, InjectionProbe
from proxy.observe import InjectionRefusals
from proxy.recorder import RECORDER, Recorder
from proxy.upstream.leg import UpstreamLeg
from proxy.upstream.pools import UPSTREAM_LEG

__all__ = ["INJECTION_REFUSALS", "SERVICES", "Services", "gather_services"]

# Engines that refused the injection, remembered for a while so each costs one retried request.
INJECTION_REFUSALS = web.AppKey("injection_refusals", InjectionRefusals)


@dataclass(frozen=True, slots=True)
class Services:
    """The app's long-lived objects an exchange reads, each an attribute away."""

    app: web.Application  # for what runs rarely (a probe, a refusal's record)
    settings: Settings
    engine: EngineState
    recorder: Recorder
    admission: Admission
    leg: UpstreamLeg
    budget: BodyBudget
    injection_refusals: InjectionRefusals
    injection_probe: InjectionProbe


SERVICES = web.AppKey("forward_services", Services)


def gather_services(app: web.Application) -> Services:
    """The record, once the app has started: the upstream leg opens in its own lifetime's start,
    which runs before forwarding's (proxy/forward/engine_exchange.py, `setup_forward`)."""
    return Services(
        app=app,
        settings=app[SETTINGS],
        engine=app[ENGINE],
        recorder=app[RECORDER],
        admission=app[ADMISSION],
        leg=app[UPSTREAM_LEG],
        budget=app[BODY_BUDGET],
        injection_refusals=app[INJECTION_REFUSALS],
        injection_probe=app[INJECTION_PROBE],
    )
