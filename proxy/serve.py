"""Runs the sidecar: event loop, signals, and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import resource
import signal
import socket
import sys
from collections.abc import AsyncIterator

from aiohttp import web
from yarl import URL

from proxy.app import build_app
from proxy.config import Settings
from proxy.evidence.keys import KeyFileError, load_signing_key
from proxy.health import HEALTH
from proxy.inbound import CONNECTIONS, PROBE_SLOTS, GuardedSite
from proxy.logs import log_event
from proxy.probe_listener import PROBE_CONNECTIONS, ProbeListener
from proxy.redact import redact_url
from proxy.reset.service import RESETS

__all__ = ["ListenError", "make_runner", "make_site", "points_at_itself", "run", "serve", "serving"]

log = logging.getLogger("cachewitness.serve")

# After grace_period the remaining handlers are cancelled; this bounds their `finally` blocks
# (records written, upstream closed). aiohttp applies its shutdown_timeout twice (once waiting
# for handlers, once more after cancelling them), so grace_period itself is waited by serve().
_CANCELLED_HANDLERS_S = 0.2
# File descriptors beyond two per client connection (client + upstream): listener, evidence,
# health probes, the event loop's own.
_FD_RESERVE = 64


class ListenError(Exception):
    """The listen address cannot be used: the message says which and what to do."""


def _addresses(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP addresses `host` names (empty when it does not resolve now)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    return {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos}


def _is_local(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a connection to `address` reaches this machine (it can be bound here)."""
    if address.is_loopback or address.is_unspecified:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(address), 0))
    except OSError:
        return False
    return True


def points_at_itself(upstream: str, listen_host: str, listen_port: int) -> bool:
    """Whether connecting to `upstream` would reach the sidecar's own listening socket.

    Such a sidecar forwards every request to itself, and each hangs until read_timeout.
    """
    url = URL(upstream)
    if listen_port == 0 or url.port != listen_port or not url.host:
        return False
    targets = _addresses(url.host)
    wildcard = {"": None, "0.0.0.0": 4, "::": 6}
    if listen_host in wildcard:
        # 0.0.0.0 takes IPv4 only; "::" takes both (Linux's default, bindv6only=0).
        versions = {4} if wildcard[listen_host] == 4 else {4, 6}
        return any(t.version in versions and _is_local(t) for t in targets)
    listened = _addresses(listen_host)
    # A connection to 0.0.0.0 / :: lands on the loopback address.
    loopback = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    return bool(listened & {a for t in targets for a in (loopback if t.is_unspecified else {t})})


def _check_not_itself(settings: Settings) -> None:
    """Refuse to start as our own upstream (an omitted upstream defaults to 127.0.0.1:8000)."""
    if points_at_itself(settings.upstream, settings.listen_host, settings.listen_port):
        default = " (the default upstream)" if settings.upstream == Settings.upstream else ""
        raise ListenError(
            f"config: upstream = {redact_url(settings.upstream)!r}{default} is this sidecar's own "
            f"listen address ({settings.listen}), so every request would come back to it; point "
            "--upstream (CACHEWITNESS_UPSTREAM) at the engine, or --listen elsewhere"
        )


def _install_uvloop() -> str:
    """Use uvloop when it is installed; say which loop runs."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def make_runner(app: web.Application, settings: Settings) -> web.AppRunner:
    """The runner `serve` uses (tests build theirs here, so transport behaviour is production's)."""
    return web.AppRunner(
        app,
        handle_signals=False,
        handler_cancellation=True,  # a client that leaves cancels its handler → upstream closed
        access_log=None,
        shutdown_timeout=_CANCELLED_HANDLERS_S,
        # aiohttp's own default is 3,630 s: idle keep-alive connections would hold max_connections.
        keepalive_timeout=settings.keepalive_timeout,
    )


def make_site(runner: web.AppRunner, host: str, port: int) -> GuardedSite:
    """The listening site `serve` uses: every connection through the app's ConnectionGuard."""
    return GuardedSite(runner, runner.app[CONNECTIONS], host, port, backlog=1024)


@contextlib.asynccontextmanager
async def serving(settings: Settings, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """The sidecar for `settings` on a free port of `host`, on `serve`'s own runner and site; yields its URL.

    For the demo and the benchmarks, which run a sidecar inside their own event loop.
    """
    runner = make_runner(build_app(settings), settings)
    await runner.setup()
    await make_site(runner, host, 0).start()
    bound_host, port = runner.addresses[0][:2]
    try:
        yield f"http://{bound_host}:{port}"
    finally:
        await runner.cleanup()


def _fit_fd_limit(settings: Settings) -> None:
    """Raise the soft RLIMIT_NOFILE so max_connections fit (within the hard limit); warn if they cannot.

    Past the descriptor limit accept() and the upstream connect() fail, and every request with them.
    """
    if not settings.max_connections:
        return
    needed = 2 * settings.max_connections + PROBE_SLOTS + _FD_RESERVE
    if settings.health_listen:
        needed += PROBE_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft < needed:
        log_event(
            log,
            logging.WARNING,
            "max_connections needs more file descriptors than RLIMIT_NOFILE allows; "
            "lower max_connections or raise the limit",
            max_connections=settings.max_connections,
            needed=needed,
            nofile=soft,
        )


async def serve(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop`), then shut down gracefully.

    We own the signals rather than use `web.run_app`: it exits 1 on a second SIGTERM
    and runs on_shutdown before in-flight handlers finish (docs/architecture.md).
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    _fit_fd_limit(settings)
    app = build_app(settings)
    runner = make_runner(app, settings)
    await runner.setup()
    site = make_site(runner, settings.listen_host, settings.listen_port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ListenError(
            f"config: listen = {settings.listen!r} cannot be bound ({exc.strerror or exc}); "
            "choose a free HOST:PORT with --listen or CACHEWITNESS_LISTEN"
        ) from None
    probes = await _start_probes(app, settings, runner)
    log_event(log, logging.INFO, "serving", listen=settings.listen, upstream=redact_url(settings.upstream))
    await stop.wait()
    app[HEALTH].shutting_down = True
    log_event(
        log,
        logging.INFO,
        "shutting down",
        shutdown_delay=settings.shutdown_delay,
        grace_period=settings.grace_period,
    )
    if settings.shutdown_delay:
        await asyncio.sleep(settings.shutdown_delay)
    # The grace period starts now for the requests in flight and for a reset under way alike.
    app[RESETS].begin_shutdown(settings.grace_period)
    await _finish_in_flight(runner, site, settings.grace_period)
    if probes is not None:
        await probes.stop()
    # Runs cleanup_ctx: the evidence flushed (fsync'd), the client session closed.
    await runner.cleanup()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signum)
    log_event(log, logging.INFO, "stopped")


async def _start_probes(
    app: web.Application, settings: Settings, runner: web.AppRunner
) -> ProbeListener | None:
    """The probe listener on `health_listen`, when it is set (the main runner is cleaned up if it cannot bind)."""
    if not settings.health_listen:
        return None
    probes = ProbeListener(app, settings)
    try:
        url = await probes.start()
    except OSError as exc:
        await runner.cleanup()
        raise ListenError(
            f"config: health_listen = {settings.health_listen!r} cannot be bound ({exc.strerror or exc}); "
            "choose a free HOST:PORT with --health-listen or CACHEWITNESS_HEALTH_LISTEN"
        ) from None
    log_event(log, logging.INFO, "serving probes", health_listen=url)
    return probes


async def _finish_in_flight(runner: web.AppRunner, site: GuardedSite, grace_period: float) -> None:
    """Stop accepting, let in-flight requests and streams finish for up to grace_period, then cut them."""
    await site.stop()
    # As aiohttp's own cleanup does: let connections accepted just before the stop start their
    # handler, then close the idle ones now (a busy one closes after its response).
    await asyncio.sleep(0)
    guard = runner.app[CONNECTIONS]
    if runner.server is not None:
        runner.server.pre_shutdown()
    guard.close_idle()
    if await guard.wait_requests_done(grace_period):
        return
    log_event(
        log,
        logging.WARNING,
        "grace period over; cutting the requests still in flight",
        requests=guard.requests_in_progress,
        grace_period=grace_period,
    )
    guard.close_all()  # handler cancellation then aborts each one's upstream request


def run(settings: Settings) -> int:
    """Blocking entry point of `cachewitness serve`; exit code 0 after a clean shutdown."""
    try:
        _check_not_itself(settings)
        if settings.evidence_signing_key_file:
            load_signing_key(settings.evidence_signing_key_file)
    except ListenError as exc:
        print(f"cachewitness: {exc}", file=sys.stderr)
        return 2
    except KeyFileError as exc:
        print(f"cachewitness: config: evidence_signing_key_file {exc}", file=sys.stderr)
        return 2
    loop_kind = _install_uvloop()
    log_event(log, logging.INFO, "starting", event_loop=loop_kind)
    try:
        asyncio.run(serve(settings))
    except ListenError as exc:
        print(f"cachewitness: {exc}", file=sys.stderr)
        return 2
    return 0
