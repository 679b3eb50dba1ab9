"""Runs the sidecar: event loop, signals, and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

from aiohttp import web

from proxy.app import build_app
from proxy.config import Settings
from proxy.health import HEALTH
from proxy.logs import log_event
from proxy.redact import redact_url

__all__ = ["ListenError", "make_runner", "make_site", "run", "serve"]

log = logging.getLogger("cachewitness.serve")


class ListenError(Exception):
    """The listen address cannot be bound: the message says which and what to do."""


def _install_uvloop() -> str:
    """Use uvloop when it is installed; say which loop runs."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def make_runner(app: web.Application, settings: Settings) -> web.AppRunner:
    """The runner `serve` uses; tests build theirs here so transport behaviour is production's."""
    return web.AppRunner(
        app,
        handle_signals=False,
        handler_cancellation=True,  # a client that leaves cancels its handler → upstream closed
        access_log=None,
        shutdown_timeout=settings.grace_period,
    )


def make_site(runner: web.AppRunner, host: str, port: int) -> web.TCPSite:
    """The listening site `serve` uses (port 0 picks a free one)."""
    return web.TCPSite(runner, host, port, backlog=1024)


async def serve(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop`), then shut down gracefully.

    We own the signals rather than use `web.run_app`: it exits 1 on a second SIGTERM
    and runs on_shutdown before in-flight handlers finish (SPEC §11).
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
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
    # Stops accepting, lets in-flight requests and streams finish up to grace_period, then
    # runs cleanup_ctx (evidence flushed, client session closed).
    await runner.cleanup()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signum)
    log_event(log, logging.INFO, "stopped")


def run(settings: Settings) -> int:
    """Blocking entry point of `cachewitness serve`; exit code 0 after a clean shutdown."""
    loop_kind = _install_uvloop()
    log_event(log, logging.INFO, "starting", event_loop=loop_kind)
    try:
        asyncio.run(serve(settings))
    except ListenError as exc:
        print(f"cachewitness: {exc}", file=sys.stderr)
        return 2
    return 0
