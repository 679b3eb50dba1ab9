"""The TCP site whose connections go through the app's ConnectionGuard (serve.py, probe_listener.py)."""

from __future__ import annotations

import asyncio

from aiohttp import web
from yarl import URL

from proxy.inbound.guard import ConnectionGuard

__all__ = ["GuardedSite"]


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through the app's ConnectionGuard."""

    def __init__(
        self, runner: web.BaseRunner, guard: ConnectionGuard, host: str, port: int, *, backlog: int = 1024
    ) -> None:
        """Listen on host:port (port 0 picks a free one: see `port`)."""
        super().__init__(runner, backlog=backlog)
        self._guard = guard
        self._host = host
        self._port = port
        self._listener: asyncio.Server | None = None

    @property
    def name(self) -> str:
        """The URL this site serves."""
        return str(URL.build(scheme="http", host=self._host, port=self.port))

    @property
    def port(self) -> int:
        """The bound port (the one asked for, until started)."""
        if self._listener is not None and self._listener.sockets:
            return int(self._listener.sockets[0].getsockname()[1])
        return self._port

    async def start(self) -> None:
        """Bind and start accepting."""
        await super().start()
        server = self._runner.server
        assert server is not None, "runner.setup() must run before site.start()"
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            self._guard.protocol_factory(server),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
        )
        self._server = self._listener  # what BaseSite.stop() closes
