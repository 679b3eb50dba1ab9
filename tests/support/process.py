"""A sidecar as a user runs it (`python -m proxy serve` in a child process), and raw connections to it."""

from __future__ import annotations

import asyncio
import resource
import sys
from pathlib import Path

import aiohttp
from yarl import URL

from tests.support.client import CLIENT_TIMEOUT
from tests.support.metrics import Scrape
from tests.support.ports import fixed_ports


async def wait_status(session: aiohttp.ClientSession, url: str, status: int, bound_s: float = 10) -> None:
    """Poll `url` until it answers `status` (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while True:
        async with session.get(url) as response:
            if response.status == status:
                return
        assert loop.time() < deadline, f"{url} never answered {status}"
        await asyncio.sleep(0.05)


# What the sidecar says when another process took the port fixed_ports() found before the child
# bound it (another test asking for the same one): that start is tried again on a fresh port.
_PORT_TAKEN = "address already in use"


async def start_sidecar(
    upstream: str, tmp_path: Path, *extra: str, nofile: int | None = None
) -> tuple[asyncio.subprocess.Process, str]:
    """`python -m proxy serve` on a free loopback port, waited on until ready (bounded).

    `nofile` sets the child's RLIMIT_NOFILE (soft and hard) before it starts.
    """
    for _ in range(3):
        started = await _start_sidecar(upstream, tmp_path, extra, nofile)
        if started is not None:
            return started
    raise AssertionError("the sidecar's listen port was taken three times")


async def _start_sidecar(
    upstream: str, tmp_path: Path, extra: tuple[str, ...], nofile: int | None
) -> tuple[asyncio.subprocess.Process, str] | None:
    """One start (None: its listen port was taken before it could bind it)."""
    # Below the ephemeral range (tests/support/ports.py): a port from it can be given to another
    # test's server while the child starts, which then answers its readiness probe (CI saw one,
    # the child signalled before it had a handler: -15).
    port = fixed_ports()

    def limit_fds() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    log_path = tmp_path / "sidecar.log"
    with open(log_path, "wb") as log:  # the child keeps its own copy of the fd
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--upstream",
            upstream,
            "--listen",
            f"127.0.0.1:{port}",
            "--evidence",
            str(tmp_path / "ev.jsonl"),
            "--health-interval",
            "0.2",
            *extra,
            stderr=log,
            preexec_fn=limit_fds,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while True:
                try:
                    await wait_status(session, url + "/-/ready", 200, bound_s=30)
                    break
                except aiohttp.ClientConnectionError:
                    if process.returncode is not None:
                        said = log_path.read_text(errors="replace")
                        if f"listen = '127.0.0.1:{port}' cannot be bound" in said and _PORT_TAKEN in said:
                            return None
                        raise AssertionError(
                            f"the sidecar exited ({process.returncode}): {said[-2000:]}"
                        ) from None
                    assert loop.time() < deadline, log_path.read_text()
                    await asyncio.sleep(0.1)
    except BaseException:
        if process.returncode is None:
            process.kill()  # a sidecar that never got ready must not outlive its test
        await process.wait()
        raise
    return process, url


BOUND_S = 20.0  # far above every limit used here; only reached when a connection is never closed


async def open_raw(url: str, payload: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw TCP connection to the sidecar that has sent `payload` and then goes silent."""
    parsed = URL(url)
    reader, writer = await asyncio.open_connection(parsed.host, parsed.port)
    if payload:
        writer.write(payload)
        await writer.drain()
    return reader, writer


async def read_until_closed(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> bytes:
    """Everything the sidecar sends before it closes the connection (bounded); then our end closes."""
    reader, writer = connection
    try:
        return await asyncio.wait_for(reader.read(), timeout=BOUND_S)
    finally:
        writer.close()


async def scrape_fresh(url: str) -> Scrape:
    """GET /metrics on a fresh connection."""
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session,
        session.get(url + "/metrics") as response,
    ):
        return Scrape(await response.text())


async def stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM the sidecar and wait for it."""
    process.terminate()
    await asyncio.wait_for(process.wait(), timeout=BOUND_S)
