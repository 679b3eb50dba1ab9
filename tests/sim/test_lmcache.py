"""The simulator's LMCache tier on vllm: vLLM's reset leaves it, its internal API servers clear it."""

from __future__ import annotations

from typing import Any

from tests.support.ports import fixed_ports
from tests.support.sim import Sim, chat, fast, sim, words


def lmcache(**options: Any) -> tuple[int, Any]:
    """A first port and a vllm simulator with LMCache on two workers from it."""
    start = fixed_ports(3)
    return start, fast("vllm", lmcache=True, lmcache_port_start=start, lmcache_workers=2, **options)


async def delete(s: Sim, port: int) -> tuple[int, Any]:
    """DELETE /cache/clear at one internal API server."""
    async with s.http.delete(f"http://127.0.0.1:{port}/cache/clear") as resp:
        return resp.status, await resp.json(content_type=None)


async def test_vllms_reset_leaves_lmcache_and_the_workers_clear_it() -> None:
    start, config = lmcache()
    async with sim(config) as s:
        body = chat(words(40))
        await s.cached(body)
        assert await s.post_json("/reset_prefix_cache?reset_external=true", {}) == (200, {"success": True})
        assert await s.cached(body) > 0  # served from LMCache
        assert await delete(s, start) == (
            503,
            {"error": "LMCache API is unavailable", "message": "LMCache engine not configured."},
        )
        for port in (start + 1, start + 2):
            status, answer = await delete(s, port)
            assert status == 200 and answer["status"] == "success" and answer["num_removed"] > 0
        await s.post_json("/reset_prefix_cache?reset_external=true", {})
        assert await s.cached(body) == 0


async def test_leaves_warm_answers_success_and_removes_nothing() -> None:
    start, config = lmcache(lmcache_leaves_warm=True)
    async with sim(config) as s:
        body = chat(words(40))
        await s.cached(body)
        assert await delete(s, start + 1) == (200, {"status": "success", "num_removed": 0})
        await s.post_json("/reset_prefix_cache?reset_external=true", {})
        assert await s.cached(body) > 0


async def test_lmcache_keys_its_chunks_by_the_salt() -> None:
    _start, config = lmcache()
    async with sim(config) as s:
        salted = chat(words(40), cache_salt="a")
        await s.cached(salted)
        await s.post_json("/reset_prefix_cache", {})  # the device tier empty: LMCache alone holds it
        assert await s.cached(chat(words(40), cache_salt="b")) == 0  # another salt's chunks are not its
        assert await s.cached(chat(words(40))) == 0  # nor an unsalted request's
        assert await s.cached(salted) > 0  # its own salt's are
