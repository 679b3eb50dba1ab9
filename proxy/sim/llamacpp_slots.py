"""llama.cpp's slots in the simulator: each slot's KV, who holds it, and the `/slots` routes
(listing, and erase/save/restore, which wait for a busy slot as llama-server defers them)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.sim.dialect import SimDialect
from proxy.sim.engine import Sequence
from proxy.sim.text import common_prefix
from proxy.sim.wire import json_body, read_json

__all__ = ["N_CTX", "Slot", "SlotsDialect", "llama_error"]

N_CTX = 4096
NOT_SUPPORTED = {
    "error": {
        "code": 501,
        "message": "This server does not support slots action. Start it with `--slot-save-path`",
        "type": "not_supported_error",
    }
}


def llama_error(status: int, message: str, err_type: str = "invalid_request_error") -> web.Response:
    """llama-server's error shape."""
    return json_body({"error": {"code": status, "message": message, "type": err_type}}, status)


@dataclass(eq=False)
class Slot:
    """One llama.cpp slot: its KV tokens and who holds it."""

    id: int
    tokens: list[str] = field(default_factory=list)
    n_prompt_tokens: int = 0
    last_used: int = 0
    processing: bool = False
    claims: int = 0  # holders plus waiters (requests and erases)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SlotsDialect(SimDialect):
    """A dialect with llama-server's slots: taking and giving them back, and the `/slots` routes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Make the slots."""
        super().__init__(*args, **kwargs)
        self.slots = [Slot(i) for i in range(self.config.slots)]
        self._clock = itertools.count(1)
        self._freed = asyncio.Event()

    async def _take(self, slot: Slot) -> None:
        """Hold a slot, waiting (deferred) while someone else does."""
        slot.claims += 1
        deferred = slot.lock.locked()
        if deferred:
            self.engine.waiting += 1
            self.engine.state_changed()
        try:
            await slot.lock.acquire()
        except BaseException:
            slot.claims -= 1
            raise
        finally:
            if deferred:
                self.engine.waiting -= 1

    def _give(self, slot: Slot) -> None:
        """Let go of a slot and wake requests waiting for any free slot."""
        slot.claims -= 1
        slot.lock.release()
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()

    def _pick_free(self, seq: Sequence) -> Slot | None:
        """A free slot: the one sharing the longest prefix with the prompt, else the least recently used."""
        best: Slot | None = None
        best_len = 0
        oldest: Slot | None = None
        for slot in self.slots:
            if slot.claims:
                continue
            n = common_prefix(slot.tokens, seq.prompt)
            if n > best_len:
                best, best_len = slot, n
            if oldest is None or slot.last_used < oldest.last_used:
                oldest = slot
        return best if best is not None else oldest

    async def _wait_free(self, seq: Sequence) -> Slot:
        """The best free slot, deferring (counted waiting) while none is free."""
        while (slot := self._pick_free(seq)) is None:
            freed = self._freed
            self.engine.waiting += 1
            self.engine.state_changed()
            try:
                await freed.wait()
            finally:
                self.engine.waiting -= 1
        return slot

    async def handle_slots(self, request: web.Request) -> web.Response:
        """GET /slots."""
        return json_body(
            [
                {
                    "id": s.id,
                    "id_task": -1,
                    "n_ctx": N_CTX,
                    "speculative": False,
                    "is_processing": s.processing,
                    "n_prompt_tokens": s.n_prompt_tokens,
                    "n_tokens": len(s.tokens),
                }
                for s in self.slots
            ]
        )

    async def handle_slot_action(self, request: web.Request) -> web.Response:
        """POST /slots/{id}?action=erase|save|restore (needs --slot-save-path, else 501)."""
        if self.config.slot_save_path is None:
            return json_body(NOT_SUPPORTED, 501)
        try:
            id_slot = int(request.match_info["id_slot"])
        except ValueError:
            return llama_error(400, "Invalid slot id")
        action = request.query.get("action", "")
        if action not in ("erase", "save", "restore"):
            return llama_error(400, "Invalid action")
        if id_slot == -1:
            return json_body({"id_slot": -1, "n_erased": 0})
        # Ids wrap modulo the slot count, as llama-server's task routing does.
        slot = self.slots[id_slot % len(self.slots)]
        filename = ""
        if action != "erase":
            body = await read_json(request)
            if isinstance(body, web.Response):
                return body
            filename = body.get("filename", "")
            if (
                not isinstance(filename, str)
                or not filename
                or "/" in filename
                or "\\" in filename
                or filename.startswith(".")
            ):
                return llama_error(400, "Invalid filename")
        # A busy slot's action is deferred until its generation ends: the call blocks.
        await self._take(slot)
        try:
            started = time.perf_counter()
            if action == "erase":
                n_erased = len(slot.tokens)
                slot.tokens = []
                slot.n_prompt_tokens = 0
                self.engine.resets_total += 1
                return json_body({"id_slot": slot.id, "n_erased": n_erased})
            path = os.path.join(self.config.slot_save_path, filename)
            if action == "save":
                data = json.dumps(slot.tokens).encode()
                await asyncio.to_thread(_write_file, path, data)
                ms = (time.perf_counter() - started) * 1000.0
                return json_body(
                    {
                        "id_slot": slot.id,
                        "filename": filename,
                        "n_saved": len(slot.tokens),
                        "n_written": len(data),
                        "timings": {"save_ms": ms},
                    }
                )
            try:
                data = await asyncio.to_thread(_read_file, path)
                tokens = json.loads(data)
            except (OSError, ValueError):
                return llama_error(
                    400, "Unable to restore slot, no available space in KV cache or invalid slot save file"
                )
            slot.tokens = [str(t) for t in tokens]
            ms = (time.perf_counter() - started) * 1000.0
            return json_body(
                {
                    "id_slot": slot.id,
                    "filename": filename,
                    "n_restored": len(slot.tokens),
                    "n_read": len(data),
                    "timings": {"restore_ms": ms},
                }
            )
        finally:
            self._give(slot)


def _write_file(path: str, data: bytes) -> None:
    """Write a slot save file."""
    with open(path, "wb") as f:
        f.write(data)


def _read_file(path: str) -> bytes:
    """Read a slot save file."""
    with open(path, "rb") as f:
        return f.read()
