"""llama-server's idle sleep (`--sleep-idle-seconds`) and router mode (no `--model`), as the simulator plays them.

Sleep (ggml-org/llama.cpp #18228): after N seconds without a task the server unloads the model
and its KV cache; `/props` says `is_sleeping` and, like `/health` and `/v1/models`, does not wake
it; anything that queues a task (a completion, `/metrics`, `/slots`) wakes it, cold.

Router mode (tools/server/server-models.cpp, ggml-org/llama.cpp 00dd081): `/props` answers
`role: "router"`; `/props`, `/slots` and `/metrics` are proxied to a child named by `?model=`, and
without one answer 400 "model name is missing from the request" (#22373, #22879).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from proxy.sim.llamacpp_slots import llama_error

__all__ = ["IdleSleep", "router_props", "without_model"]


class IdleSleep:
    """The server's sleep state: asleep after `seconds` idle, woken by the next task."""

    def __init__(self, seconds: float | None, unload: Callable[[], None]) -> None:
        """`seconds` None: never sleeps; `unload` drops the model's KV (every slot, the RAM cache)."""
        self.seconds = seconds
        self._unload = unload
        self._last = time.monotonic()
        self._asleep = False
        self.sleeps_total = 0
        self.wakes_total = 0

    def asleep(self, busy: bool) -> bool:
        """Whether the server sleeps now (falling asleep unloads the KV); a probe, it wakes nothing."""
        if self.seconds is None or busy:
            return self._asleep
        if not self._asleep and time.monotonic() - self._last >= self.seconds:
            self._asleep = True
            self.sleeps_total += 1
            self._unload()
        return self._asleep

    def task(self, busy: bool) -> None:
        """A task arrived (or ended): wake a sleeping server; the idle clock starts again."""
        if self.asleep(busy):
            self._asleep = False
            self.wakes_total += 1
        self._last = time.monotonic()

    def stats(self) -> dict[str, object]:
        """`/sim/stats` members."""
        return {"sleeping": self._asleep, "sleeps_total": self.sleeps_total, "wakes_total": self.wakes_total}


def router_props(version: str) -> dict[str, Any]:
    """The router's own `/props` (server_models_routes::init_routes, get_router_props)."""
    return {
        "role": "router",
        "max_instances": 4,
        "models_autoload": True,
        "model_alias": "llama-server",
        "model_path": "none",
        "default_generation_settings": {"params": {}, "n_ctx": 0},
        "build_info": version,
    }


def without_model(request: web.Request, served: str) -> web.Response | None:
    """The router's answer to a per-model route without (or with an unknown) `?model=`; None: the child answers."""
    name = request.query.get("model", "")
    if not name:
        return llama_error(400, "model name is missing from the request")
    if name != served:
        return llama_error(400, f"model '{name[:64]}' not found")
    return None
