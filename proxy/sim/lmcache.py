"""LMCache as vLLM's offload tier (`--lmcache`): the tier, and each vLLM process's internal API server.

LMCache 0.5.6 (lmcache/v1/internal_api_server/api_server.py) serves one API per vLLM process on
`internal_api_server_port_start` + 0 for the scheduler and + 1 + worker id for each worker. Only
a worker holds a cache engine: `DELETE /cache/clear` there answers 200
`{"status": "success", "num_removed": N}`; the scheduler's answers 503 "LMCache API is
unavailable" (vllm/cache_api.py, `_check_lmcache_engine`). Each worker stores its own shard of
every chunk, so a prefix is retrieved only while every worker still has it. `--lmcache-leaves-warm`
answers success and removes nothing, as users report of LMCache (#1692, #1693).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence

from aiohttp import web

from proxy.sim.cache import PrefixCache
from proxy.sim.config import SimConfig
from proxy.sim.wire import json_body

__all__ = ["LmcacheTier", "serve_lmcache"]

LMCACHE_VERSION = "0.5.6"
_UNAVAILABLE = {"error": "LMCache API is unavailable", "message": "LMCache engine not configured."}


class LmcacheTier:
    """The LMCache tier: one shard cache per worker, and its hit counter (`lmcache:num_hit_tokens`)."""

    def __init__(self, config: SimConfig) -> None:
        """Empty shards, one per worker."""
        self.config = config
        self.shards = [
            PrefixCache(config.block_size, config.cache_blocks) for _ in range(config.lmcache_workers)
        ]
        self.hit_tokens = 0
        self.clears = 0

    def lookup(self, prompt: Sequence[str], root: int = 0) -> int:
        """Tokens every worker can retrieve (`root`: the request's salt, as PrefixCache.lookup)."""
        return min(shard.lookup(prompt, root) for shard in self.shards)

    def store(self, tokens: Sequence[str], root: int = 0) -> None:
        """Every worker stores its shard of the prompt's chunks, keyed by the salt as vLLM's own tier."""
        for shard in self.shards:
            shard.insert(tokens, root)

    def forget(self) -> None:
        """A restart: the local tier goes with the processes; the counter restarts at 0."""
        for shard in self.shards:
            shard.clear()
        self.hit_tokens = 0

    def app(self, offset: int) -> web.Application:
        """The internal API server at port offset `offset` (0: the scheduler, 1 + w: worker w)."""
        app = web.Application()

        async def version(request: web.Request) -> web.Response:
            """GET /lmc_version, /version (version_api.py)."""
            return json_body(LMCACHE_VERSION)

        app.router.add_get("/lmc_version", version)
        app.router.add_get("/version", version)

        async def clear(request: web.Request) -> web.Response:
            """DELETE /cache/clear[?locations=...]: the worker's shard (the sim has one location)."""
            if offset == 0:
                return json_body(_UNAVAILABLE, 503)
            self.clears += 1
            removed = 0 if self.config.lmcache_leaves_warm else self.shards[offset - 1].clear()
            body = json.dumps({"status": "success", "num_removed": removed}, indent=2)
            return web.Response(text=body, content_type="application/json")

        app.router.add_delete("/cache/clear", clear)
        return app


async def serve_lmcache(tier: LmcacheTier, host: str = "127.0.0.1") -> AsyncIterator[None]:
    """Serve the scheduler's and every worker's API on consecutive ports for the app's lifetime."""
    runners: list[web.AppRunner] = []
    try:
        for offset in range(tier.config.lmcache_workers + 1):
            runner = web.AppRunner(tier.app(offset), access_log=None, shutdown_timeout=1)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, host, tier.config.lmcache_port_start + offset).start()
        yield
    finally:
        for runner in runners:
            await runner.cleanup()
