"""The sidecar in front of a real llama.cpp llama-server (tiny GGUF, CPU)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp

from tests.real.conftest import Pair
from tests.real.sidecar_client import (
    cache_state,
    cache_state_record,
    complete,
    engine_info_labels,
    eventually,
    find_key,
    long_prompt,
    new_case,
    reset,
    tags,
    verification,
)
from tests.support.client import CLIENT_TIMEOUT

MODEL = "tiny"
# More tokens than the slot can decode in the wait below (measured ~250 tok/s
# late in an 8k context): a stream that ends early was cut, not finished.
LONG_GENERATION = 7000


async def _props(s: aiohttp.ClientSession, pair: Pair) -> dict[str, Any]:
    """The engine's own GET /props."""
    async with s.get(f"{pair.engine_url}/props") as resp:
        props: dict[str, Any] = await resp.json()
        return props


async def _slots(s: aiohttp.ClientSession, pair: Pair) -> list[dict[str, Any]]:
    """The engine's own GET /slots."""
    async with s.get(f"{pair.engine_url}/slots") as resp:
        slots: list[dict[str, Any]] = await resp.json()
        return slots


async def test_auto_detects_llamacpp_and_its_build(llama: Pair) -> None:
    """`--engine auto` finds llama.cpp and reports the build from /props."""
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        build_info = (await _props(s, llama))["build_info"]
        infos = await engine_info_labels(s, llama.url)
    assert [i["kind"] for i in infos] == ["llamacpp"], infos
    version = infos[0]["version"]
    assert version and (version in build_info or build_info in version), (version, build_info)


async def test_reset_erases_every_slot_and_is_acknowledged(llama: Pair) -> None:
    """A reset calls erase on each of the engine's slots and answers acknowledged."""
    session_id, case_id = new_case()
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        total_slots = (await _props(s, llama))["total_slots"]
        # No canary: one reset, one erase per slot (test_real_canary.py has the canary's).
        status, answer = await reset(s, llama.url, session_id=session_id, case_id=case_id, verify="none")
    assert status == 200, answer
    assert answer["answer"] == "acknowledged" and answer["success"] is True, answer
    assert answer["engine"]["kind"] == "llamacpp"
    erases = [c for c in answer["calls"] if "action=erase" in str(c)]
    assert len(erases) == total_slots, answer["calls"]
    assert all(200 in find_key(c, "status") for c in erases), erases
    assert answer["cache_state"]["session_id"] == session_id


CHAT = "/v1/chat/completions"


def _chat(max_tokens: int = 8) -> dict[str, Any]:
    """A chat request with a fresh long prompt."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": long_prompt()}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


async def test_a_clients_slot_erase_is_forwarded_and_recorded(llama: Pair) -> None:
    """`POST /slots/0?action=erase` through the sidecar: llama-server's own answer, and a native record."""
    session_id, case_id = new_case()
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        async with s.post(f"{llama.url}/slots/0?action=erase", headers=tags(session_id, case_id)) as resp:
            status, body = resp.status, await resp.json()
        record = await cache_state_record(s, llama.url, case_id)
    assert status == 200 and body["id_slot"] == 0 and "n_erased" in body, body
    assert record["via"] == "native" and record["route"] == "POST /slots/0?action=erase"
    assert record["acknowledged"] is True and record["reset"]["status"] == 200


async def test_erase_with_cache_ram_off_is_verified_consistent(llama: Pair) -> None:
    """With `--cache-ram 0` an erase leaves a cold cache: the verdict is consistent."""
    session_id, case_id = new_case()
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 4, "temperature": 0}
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        await complete(s, llama.url, body)  # warm the cache with this prompt
        status, answer = await reset(s, llama.url, session_id=session_id, case_id=case_id)
        assert status == 200 and answer["answer"] == "acknowledged", answer
        await complete(s, llama.url, body, tags(session_id, case_id))
        record = await verification(s, llama.url, answer["reset_id"])
        state = await cache_state(s, llama.url)
    assert record["verdict"] == "consistent", record
    assert record["cached_tokens"] == 0 and record["case_id"] == case_id
    assert "consistent" in find_key(state, "verdict"), state


async def test_erase_with_default_ram_cache_is_contradicted(llama_ram_cache: Pair) -> None:
    """llama.cpp's host-RAM prompt cache survives erase: acknowledged, yet the verdict is contradicted."""
    pair = llama_ram_cache
    session_id, case_id = new_case()
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 4, "temperature": 0}
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        await complete(s, pair.url, body)  # the prompt now lives in a slot...
        # ...and a different prompt on the same slot moves it into the RAM cache.
        await complete(s, pair.url, {**body, "prompt": long_prompt()})
        # No canary (it would answer 502 contradicted): the traffic is the witness here.
        status, answer = await reset(s, pair.url, session_id=session_id, case_id=case_id, verify="none")
        assert status == 200 and answer["answer"] == "acknowledged", answer
        await complete(s, pair.url, body, tags(session_id, case_id))
        record = await verification(s, pair.url, answer["reset_id"])
        state = await cache_state(s, pair.url)
    assert record["verdict"] == "contradicted", record
    assert record["cached_tokens"] > 0
    assert "contradicted" in find_key(state, "verdict"), state


async def test_reset_without_slot_save_path_is_unsupported_with_hint(llama_without_slot_save: Pair) -> None:
    """Without `--slot-save-path` llama.cpp has no erase: 501 unsupported, and the hint names the flag."""
    session_id, case_id = new_case()
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        status, answer = await reset(s, llama_without_slot_save.url, session_id=session_id, case_id=case_id)
    assert status == 501, answer
    assert answer["answer"] == "unsupported" and answer["success"] is False
    assert "--slot-save-path" in answer["hint"]


async def test_client_disconnect_mid_stream_frees_the_slot(llama: Pair) -> None:
    """A client that drops a stream makes the sidecar abort it: the slot goes idle, cut short."""
    body = {
        "model": MODEL,
        "prompt": "Tell a very long story.",
        "max_tokens": LONG_GENERATION,
        "temperature": 0,
        "stream": True,
        "id_slot": 0,
    }
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as client:
            resp = await client.post(f"{llama.url}/v1/completions", json=body)
            assert resp.status == 200
            for _ in range(5):  # a few chunks: the slot is decoding
                assert await resp.content.readline()
            busy = await _slots(s, llama)
            assert busy[0]["is_processing"] is True
            resp.close()  # drop the connection mid-stream

        async def slot_idle() -> dict[str, Any] | None:
            """Slot 0 once it stopped processing."""
            slot = (await _slots(s, llama))[0]
            return None if slot["is_processing"] else slot

        slot = await eventually(slot_idle, 15.0, "slot 0 idle after the client left")
    # The slot holds prompt + decoded tokens: fewer than asked means the generation was cut.
    assert slot["n_prompt_tokens"] < LONG_GENERATION, slot


async def test_busy_slot_erase_still_acknowledged_after_drain(llama: Pair) -> None:
    """A reset during a generation drains it first, then every erase succeeds."""
    session_id, case_id = new_case()
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 1500, "temperature": 0}
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        generation = asyncio.create_task(complete(s, llama.url, body))

        async def processing() -> bool | None:
            """True once a slot is busy."""
            return True if any(x["is_processing"] for x in await _slots(s, llama)) else None

        await eventually(processing, 15.0, "a slot busy with the generation")
        status, answer = await reset(s, llama.url, session_id=session_id, case_id=case_id)
        done = await generation
        record = await cache_state_record(s, llama.url, case_id)
    assert status == 200 and answer["answer"] == "acknowledged", answer
    assert done["usage"]["completion_tokens"] == 1500  # the drain let it finish
    assert answer["drain"]["inflight_at_start"] >= 1
    assert record["reset"]["answer"] == "acknowledged"


async def test_busy_slot_without_drain_is_refused_within_the_retry_window(llama: Pair) -> None:
    """A generating slot makes a real erase block; the sidecar reads /slots and refuses in time."""
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": LONG_GENERATION, "temperature": 0}
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        generation = asyncio.create_task(complete(s, llama.url, body))

        async def processing() -> bool | None:
            """True once a slot is busy."""
            return True if any(x["is_processing"] for x in await _slots(s, llama)) else None

        try:
            await eventually(processing, 15.0, "a slot busy with the generation")
            started = time.monotonic()
            status, answer = await reset(s, llama.url, drain=False, retry_seconds=2)
            took_s = time.monotonic() - started
        finally:
            generation.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await generation
    assert status == 409 and answer["answer"] == "refused", answer
    assert answer["attempts"] >= 2
    # Before: one erase that blocked until the generation ended (30.5 s seen).
    assert took_s < 4.0, took_s
    assert not [c for c in answer["calls"] if "action=erase" in c["url"]]
