"""No reset at all: `--engine none`, and engines known to have none (TGI, Ollama, plain OpenAI)."""

from __future__ import annotations

import aiohttp

from proxy.engines.base import Attempt, AttemptPlan, Dialect, unsupported
from proxy.vocabulary import EngineKind

__all__ = ["NoResetDialect"]

NONE_HINT = (
    "the sidecar runs with --engine none, which switches resets off; start it with --engine auto "
    "or the engine's kind to reset through it"
)


class NoResetDialect(Dialect):
    """Answers every reset `unsupported` without calling the engine."""

    kind = EngineKind.NONE

    def __init__(self, hint: str = NONE_HINT, health_path: str = "/health") -> None:
        """`hint` says how to get a reset."""
        self._hint = hint
        self.health_path = health_path

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """No call: the reset is unsupported."""
        return unsupported(plan.base_url, "resets are switched off (--engine none)", self._hint)
