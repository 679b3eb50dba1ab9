"""Plain OpenAI-compatible dialect: prefix cache and cached-token usage, no reset endpoint."""

from __future__ import annotations

from proxy.sim.dialect import SimDialect

__all__ = ["OpenaiDialect"]


class OpenaiDialect(SimDialect):
    """A generic OpenAI server: `/health` 200, no reset route (404), `owned_by: "openai"`."""

    name = "openai"
