"""Running the simulator: blocking `run_sim` for the CLI, `running_sim` for tests and benchmarks."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from proxy.sim.config import SimConfig
from proxy.sim.server import build_sim_app

__all__ = ["run_sim", "running_sim"]

# In-flight handlers get this long at shutdown before they are cancelled.
SHUTDOWN_TIMEOUT_S = 1.0


def _runner(config: SimConfig) -> web.AppRunner:
    """An AppRunner whose handlers are cancelled when their client disconnects."""
    # handler_cancellation=True: a disconnecting client cancels the handler, so the
    # engine aborts the sequence and frees its slot (aiohttp does not by default).
    keepalive: dict[str, Any] = (
        {} if config.keepalive_timeout is None else {"keepalive_timeout": config.keepalive_timeout}
    )
    return web.AppRunner(
        build_sim_app(config),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        **keepalive,
    )


@asynccontextmanager
async def running_sim(config: SimConfig) -> AsyncIterator[str]:
    """Serve a simulator on 127.0.0.1 on a free port; yield its base URL `http://127.0.0.1:PORT`."""
    runner = _runner(config)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def _serve(config: SimConfig, host: str, port: int) -> int:
    """Serve until SIGTERM or SIGINT."""
    runner = _runner(config)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            print(f"cachewitness sim: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(
            f"cachewitness sim: {config.dialect} engine on http://{host}:{port} (model {config.served_model})",
            file=sys.stderr,
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        return 0
    finally:
        await runner.cleanup()


def run_sim(config: SimConfig, host: str = "127.0.0.1", port: int = 8000) -> int:
    """Run the simulator until SIGTERM/SIGINT (exit code 0); uvloop when available."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_serve(config, host, port))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_serve(config, host, port))
