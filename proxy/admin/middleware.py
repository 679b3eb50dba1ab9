"""The route policy, applied to every route: admin routes, engine control routes, interception.

The sidecar's own routes under /cache/ need admin auth (proxy/admin/auth.py decides who may);
every other request is classified by the route policy (proxy/admin/policy.py) for the engine
fronted now: forwarded as is, refused, guarded, or intercepted (the engine's own reset routes,
proxy/admin/native.py). See docs/routes.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from proxy.admin.auth import (
    ADMIN_PREFIX,
    admin_denial,
    engine_authorization,
    holds_token,
    peer_host,
    query_without_token,
    without_token,
)
from proxy.admin.native import handle_native_reset, handle_slot_erase
from proxy.admin.policy import RouteClass, RouteDecision, RoutePolicy
from proxy.config import SETTINGS, EngineRoutes, NativeResetAuth, Settings
from proxy.engine_state import ENGINE
from proxy.forward.refusal import PATH_REFUSAL
from proxy.refusals import REFUSALS, RefusalReason, Refusals
from proxy.upstream.pools import UPSTREAM_POOL

__all__ = ["ROUTE_CLASSES", "ROUTE_POLICY", "Handler", "Police", "route_policy", "setup_admin"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Applies the route policy to one route as it is registered: (handler, registered path) → handler.
Police = Callable[[Handler, str], Handler]
ROUTE_POLICY: web.AppKey[Police] = web.AppKey("route_policy")
# The classifier behind it, for the front (proxy/inbound/), which takes only what it forwards.
ROUTE_CLASSES: web.AppKey[RoutePolicy] = web.AppKey("route_classes", RoutePolicy)


def _toward_engine(request: web.Request, settings: Settings, *, control: bool) -> web.Request:
    """The request as the engine may see it: a clone only when a header or a query parameter must go or change."""
    admin, engine_key = settings.admin_token, settings.engine_key if control else None
    path, _, query = request.raw_path.partition("?")
    kept_query = query_without_token(query, admin) if admin is not None and query else None
    if (
        engine_key is None
        and kept_query is None
        and (
            admin is None
            or not any(holds_token(name, value, admin) for name, value in request.headers.items())
        )
    ):
        return request
    headers = CIMultiDict(without_token(request.headers.items(), admin))
    if engine_key is not None:
        headers.popall("Authorization", None)
        headers.add("Authorization", f"Bearer {engine_key}")
    if kept_query is None:
        return request.clone(headers=headers)
    # The token as a query parameter (`?api_key=...`, escaped or not): that parameter goes.
    target = f"{path}?{kept_query}" if kept_query else path
    return request.clone(headers=headers, rel_url=URL(target, encoded=True))


async def _classify(request: web.Request, policy: RoutePolicy) -> RouteDecision:
    """The route class for the engine fronted now; detection runs first if a control path meets an unknown kind."""
    engine = request.app[ENGINE]
    decision = policy.classify(request.method, request.rel_url.raw_path, request.query, engine.dialect)
    if (
        decision.route not in (RouteClass.FORWARDED, RouteClass.INVALID_TARGET)
        and not policy.knows(engine.dialect)
        and not engine.detected
    ):
        await engine.ensure_detected(request.app[UPSTREAM_POOL])
        decision = policy.classify(request.method, request.rel_url.raw_path, request.query, engine.dialect)
    return decision


def route_policy(settings: Settings, forward: Handler, policy: RoutePolicy | None = None) -> Police:
    """The route policy, applied to each route as it is registered (`police(handler, path)`).

    Decided once per route, not per request: a route of the sidecar's own under /cache/ needs
    admin auth, its other routes pass as they are, and `forward` (every other path: aiohttp's
    forwarding handler, handed down by `build_app`) gets the policy's classification. No app
    middleware: with none, aiohttp skips its middleware chain for every request (issue 34).
    """
    policy = policy if policy is not None else RoutePolicy(settings)
    guarded = settings.engine_routes == EngineRoutes.ADMIN
    reset_key = (
        settings.engine_key if settings.native_reset_auth == NativeResetAuth.UPSTREAM_API_KEY else None
    )

    async def forwarded(request: web.Request) -> web.StreamResponse:
        """Engine control routes need admin auth (or are intercepted); the rest goes to the engine."""
        decision = await _classify(request, policy)
        if decision.route is RouteClass.FORWARDED:
            return await forward(_toward_engine(request, settings, control=False))
        refusals = request.app[REFUSALS]
        if decision.route is RouteClass.INVALID_TARGET:
            reason = RefusalReason.INVALID_REQUEST_TARGET
            return _refused(request, refusals, reason, PATH_REFUSAL.response(), path=decision.path)
        if guarded:
            key = reset_key if decision.route is RouteClass.NATIVE_RESET else None
            denial = admin_denial(request, settings, engine_key=key)
            if denial is not None:
                return _refused(request, refusals, *denial, path=decision.path)
        if decision.route is RouteClass.NATIVE_RESET and decision.native is not None:
            return await handle_native_reset(request, decision.native)
        if decision.route is RouteClass.SLOT_ERASE:
            return await handle_slot_erase(
                request, decision.path, engine_authorization(request, settings, control=True)
            )
        return await forward(_toward_engine(request, settings, control=True))

    def admin_route(handler: Handler, path: str) -> Handler:
        """A sidecar route under /cache/, exactly as registered (method and path): admin auth first.

        Any other /cache/* request (another method, another path) is forwarded, and classified there.
        """

        async def admin_only(request: web.Request) -> web.StreamResponse:
            denial = admin_denial(request, settings)
            if denial is not None:
                return _refused(request, request.app[REFUSALS], *denial, path=path)
            return await handler(request)

        return admin_only

    def police(handler: Handler, path: str) -> Handler:
        if handler is forward:
            return forwarded
        if path.startswith(ADMIN_PREFIX):
            return admin_route(handler, path)
        return handler

    return police


def _refused(
    request: web.Request, refusals: Refusals, reason: RefusalReason, answer: web.Response, *, path: str
) -> web.Response:
    """Count and (throttled) log one refused request; its answer."""
    refusals.refused(reason, method=request.method, path=path, status=answer.status, peer=peer_host(request))
    return answer


def setup_admin(app: web.Application, forward: Handler) -> None:
    """The refusal counters, and the route policy that `setup_routes` applies to every route
    (`forward`: the handler of every path the sidecar does not answer itself)."""
    app[REFUSALS] = Refusals()
    policy = app[ROUTE_CLASSES] = RoutePolicy(app[SETTINGS])
    app[ROUTE_POLICY] = route_policy(app[SETTINGS], forward, policy)
