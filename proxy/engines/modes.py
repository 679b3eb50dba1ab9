"""Engines that serve in another mode than their kind's usual one: vLLM's Rust front end, llama.cpp's router.

vLLM with `VLLM_USE_RUST_FRONTEND=1` answers `/version` with `rust_frontend_version` (vllm PR
#43854). Its `/reset_prefix_cache` (rust/src/server/src/routes/cache.rs) drops the engine's
yes/no and answers a bare 200; a later variant answers 409 when the engine refused and 400 to
`reset_external=true` when no KV connector is configured. A bare 200 is `accepted_unverified`,
as vLLM before 0.26; the canary then decides (proxy/reset/silent.py retries a reset the canary
found warm). The 400 means the engine has no external tier: the reset is sent again without
`reset_external`, and the external tier is `not_requested`, with the engine's words.

llama.cpp started without `--model` is a router over several child servers (tools/server/
server-models.cpp, ggml-org/llama.cpp 00dd081): its `/props` answers `role: "router"`, it has no
`/slots` of its own (#22373) and its `/metrics` wants `?model=` (#22879). A slot erase cannot
reach every child's cache, so the reset is `unsupported` with a hint.
"""

from __future__ import annotations

from dataclasses import replace
from enum import StrEnum
from typing import Any

import aiohttp

from proxy.engines.base import Attempt, AttemptPlan, Dialect, unsupported
from proxy.engines.call import Reply, engine_call
from proxy.engines.llamacpp import CONTROL_ROUTES as LLAMACPP_CONTROL_ROUTES
from proxy.engines.response import read_response
from proxy.engines.vllm import FORCED_RULES, RULES, VllmDialect
from proxy.vocabulary import EngineKind

__all__ = [
    "ROUTER_HINT",
    "RUST_WARNING",
    "EngineMode",
    "LlamacppRouterDialect",
    "VllmRustDialect",
    "llamacpp_mode",
    "vllm_mode",
]


class EngineMode(StrEnum):
    """`EngineInfo.mode`: how an engine serves, where it is not its kind's usual way."""

    RUST_FRONTEND = "rust-frontend"  # vLLM's Rust HTTP front end
    ROUTER = "router"  # llama-server without --model, routing to child servers


def vllm_mode(version: Any) -> str | None:
    """`rust-frontend` when vLLM's `/version` has `rust_frontend_version`."""
    if isinstance(version, dict) and version.get("rust_frontend_version"):
        return EngineMode.RUST_FRONTEND.value
    return None


def llamacpp_mode(props: Any) -> str | None:
    """`router` when llama-server's `/props` says `role: "router"`."""
    if isinstance(props, dict) and props.get("role") == "router":
        return EngineMode.ROUTER.value
    return None


RUST_WARNING = (
    "vLLM's Rust front end answers a bare 200 to /reset_prefix_cache: the engine's yes or no "
    "is not passed on, so only the canary can say whether the cache was cleared"
)
RUST_RULES = replace(
    RULES,
    busy={409: "the engine refused the reset: blocks are still held"},
    unconfirmed_warning=RUST_WARNING,
)
RUST_FORCED_RULES = replace(FORCED_RULES, busy=RUST_RULES.busy, unconfirmed_warning=RUST_WARNING)
# What the Rust front end's 400 to reset_external=true costs: the external tier is not asked.
NO_EXTERNAL_TIER = "external"


class VllmRustDialect(VllmDialect):
    """vLLM behind its Rust front end: 409 is a refusal, a 400 to `reset_external` is sent again without it."""

    silent_refusals = True

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """POST /reset_prefix_cache?reset_external=true; on its 400, once more without reset_external."""
        force = "&reset_running_requests=true" if plan.force else ""
        rules = RUST_FORCED_RULES if plan.force else RUST_RULES
        url = f"{plan.base_url}/reset_prefix_cache?reset_external=true{force}"
        first = await engine_call(session, "POST", url, timeout_s=plan.timeout_s, headers=self._headers)
        if first.status != 400:
            return read_response(first, rules)
        local = f"{plan.base_url}/reset_prefix_cache?{force.lstrip('&')}".rstrip("?")
        second = await engine_call(session, "POST", local, timeout_s=plan.timeout_s, headers=self._headers)
        attempt = read_response(second, rules)
        said = _engine_message(first)
        warning = (
            f"the engine answered HTTP 400 to reset_external=true ({said}): the external tier is "
            "unsupported here, so the reset was sent again without it"
        )
        return replace(
            attempt,
            calls=(first.call, *attempt.calls),
            warning=f"{warning}; {attempt.warning}" if attempt.warning else warning,
            unsupported_tiers=(NO_EXTERNAL_TIER,),
        )


def _engine_message(reply: Reply) -> str:
    """The engine's own error message from a JSON error body, at most 200 characters."""
    payload = reply.json()
    message: Any = None
    if isinstance(payload, dict):
        error = payload.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        message = message if isinstance(message, str) else payload.get("message") or payload.get("detail")
    return str(message)[:200] if isinstance(message, str) and message else "no message"


ROUTER_HINT = (
    "llama-server runs as a router over several models (started without --model): start one "
    "llama-server per model, each with --model, and put a sidecar in front of each"
)


class LlamacppRouterDialect(Dialect):
    """llama-server in router mode: no reset reaches every child's cache, so none is sent."""

    kind = EngineKind.LLAMACPP
    control_routes = LLAMACPP_CONTROL_ROUTES

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """No engine call: the answer says why and how to get a reset."""
        error = "llama-server in router mode has no slots of its own to erase (/slots is per model)"
        return unsupported(plan.base_url, error, ROUTER_HINT, ())
