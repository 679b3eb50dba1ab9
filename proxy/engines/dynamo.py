"""NVIDIA Dynamo's frontend: `POST /clear_kv_blocks`, whose HTTP 200 says nothing by itself (docs/engines.md).

The frontend (ai-dynamo/dynamo `lib/llm/src/http/service/clear_kv_blocks.rs`) calls every
worker's `clear_kv_blocks` endpoint and always answers 200 with JSON:
`{"cleared_workers": [...], "failed_workers": [...]}`, or only `{"message": ...}` when it found
no worker group at all. A worker it could not reach is in `failed_workers`; a worker that
answered is in `cleared_workers` whatever it answered: its `response` is the worker's first
answer, serialised to a JSON *string*, and a vLLM worker whose engine refused says
`{"status": "error", "message": "KV cache reset failed"}` there (components/src/dynamo/vllm/
handlers.py). So only a body where every worker answered `"status": "success"` and none
failed acknowledges; anything else is a refusal (retried: a busy worker refuses until idle),
worded `partial` when some workers did clear.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.engines.base import Attempt, AttemptPlan, Dialect, failed_attempt, outcome_for_status, unsupported
from proxy.engines.call import Reply, bearer, engine_call
from proxy.engines.routes import NativeReset, control, control_prefix
from proxy.vocabulary import EngineKind, ResetAnswer

__all__ = ["CONTROL_ROUTES", "NATIVE_RESET", "DynamoDialect", "WorkerTally", "read_clear"]

CLEAR_PATH = "/clear_kv_blocks"
NO_ROUTE_HINT = (
    "this Dynamo frontend serves no /clear_kv_blocks: run a Dynamo frontend that has it "
    "(lib/llm/src/http/service/clear_kv_blocks.rs), or point the sidecar at a worker's engine"
)
# Worker names quoted in an error, at most (a frontend may list hundreds).
_NAMED_WORKERS = 4

# The frontend's clear, and the workers' system-port control routes (`/engine/...`,
# DistributedRuntime.register_engine_route) for a sidecar in front of a worker.
CONTROL_ROUTES = (control(CLEAR_PATH), control_prefix("/engine/"))
NATIVE_RESET = NativeReset(
    rule=control(CLEAR_PATH, "POST"),
    content_type="application/json",
    refusal_status=200,
    refusal_body=b'{"cleared_workers":[],"failed_workers":[{"status":"the cache was not cleared"}]}',
)


@dataclass(frozen=True)
class WorkerTally:
    """What one `/clear_kv_blocks` body says of the workers."""

    cleared: tuple[str, ...]  # answered `"status": "success"`
    refused: tuple[str, ...]  # answered, but not success (the engine refused, or an error)
    failed: tuple[str, ...]  # not reached (`failed_workers`)
    message: str | None = None  # the frontend's own `message`, when it listed no worker

    @property
    def all_cleared(self) -> bool:
        """Every worker listed cleared, and there was at least one."""
        return bool(self.cleared) and not self.refused and not self.failed


def _name(entry: Any) -> str:
    """A worker entry's name (bounded), or `?`."""
    name = entry.get("name") if isinstance(entry, dict) else None
    return name[:200] if isinstance(name, str) and name else "?"


def _worker_status(response: Any) -> Any:
    """The `status` of a worker's answer, given as a JSON string (the frontend's way) or an object."""
    if isinstance(response, str):
        try:
            response = json.loads(response)
        except ValueError:
            return None
    return response.get("status") if isinstance(response, dict) else None


def tally(payload: Any) -> WorkerTally | None:
    """The workers a `/clear_kv_blocks` body names; None when it is not the frontend's shape."""
    if not isinstance(payload, dict):
        return None
    cleared_list, failed_list = payload.get("cleared_workers"), payload.get("failed_workers")
    if cleared_list is None and failed_list is None:
        message = payload.get("message")
        return WorkerTally((), (), (), message[:200] if isinstance(message, str) else None)
    if not isinstance(cleared_list or [], list) or not isinstance(failed_list or [], list):
        return None
    cleared: list[str] = []
    refused: list[str] = []
    for entry in cleared_list or []:
        ok = isinstance(entry, dict) and _worker_status(entry.get("response")) == "success"
        (cleared if ok else refused).append(_name(entry))
    return WorkerTally(tuple(cleared), tuple(refused), tuple(_name(e) for e in failed_list or []))


def _named(names: tuple[str, ...]) -> str:
    """Up to a few names, and how many more."""
    shown = ", ".join(names[:_NAMED_WORKERS])
    return shown + (f" and {len(names) - _NAMED_WORKERS} more" if len(names) > _NAMED_WORKERS else "")


def _refusal(found: WorkerTally) -> str:
    """Why a body that does not acknowledge is refused, naming the workers."""
    if not (found.cleared or found.refused or found.failed):
        return f"no worker was cleared: {found.message or 'the frontend listed no worker'}"
    parts = []
    if found.refused:
        parts.append(f"{len(found.refused)} refused ({_named(found.refused)})")
    if found.failed:
        parts.append(f"{len(found.failed)} not reached ({_named(found.failed)})")
    total = len(found.cleared) + len(found.refused) + len(found.failed)
    prefix = f"partial: {len(found.cleared)} of {total} workers cleared; " if found.cleared else ""
    return prefix + "; ".join(parts)


def read_clear(reply: Reply) -> Attempt:
    """The attempt one `/clear_kv_blocks` call made: only every listed worker's success acknowledges."""
    status, url, calls = reply.status, reply.call.url, (reply.call,)
    if status is None:
        return failed_attempt(reply, url)
    if status in (404, 405):
        return unsupported(url, f"HTTP {status}: {CLEAR_PATH} is not served", NO_ROUTE_HINT, calls)
    if not 200 <= status < 300:
        outcome, error = outcome_for_status(status)
        return Attempt(outcome, status=status, error=error, url=url, calls=calls)
    found = tally(reply.json())
    if found is None:
        error = "the answer is not the frontend's {cleared_workers, failed_workers}"
        return Attempt(ResetAnswer.ERROR, status=status, error=error, url=url, calls=calls)
    if found.all_cleared:
        return Attempt(ResetAnswer.ACKNOWLEDGED, status=status, success=True, url=url, calls=calls)
    return Attempt(
        ResetAnswer.REFUSED, status=status, success=False, error=_refusal(found), url=url, calls=calls
    )


class DynamoDialect(Dialect):
    """Clears the KV blocks of every worker behind a Dynamo frontend; reads each worker's answer."""

    kind = EngineKind.DYNAMO
    control_routes = CONTROL_ROUTES
    native_reset = NATIVE_RESET

    def __init__(self, api_key: str | None = None) -> None:
        """`api_key`: the frontend's own key, sent as a bearer token, if it has one."""
        self._headers = bearer(api_key)

    async def reset_once(self, session: aiohttp.ClientSession, plan: AttemptPlan) -> Attempt:
        """POST /clear_kv_blocks and read every worker's answer in it."""
        url = f"{plan.base_url}{CLEAR_PATH}"
        reply = await engine_call(session, "POST", url, timeout_s=plan.timeout_s, headers=self._headers)
        return read_clear(reply)
