"""Whether the engine refuses the injected `include_usage`, learnt from a request the sidecar builds.

A refusal switches the injection off for every client (for `inject_usage_reprobe_seconds`),
so no client's request may decide it: a body the engine reads differently from the sidecar
(`"stream":true,"str\\u0065am":false`: a stream to the scanner, none to Python's json) drew a
400 to the injected `stream_options` and a 200 to the resend, and one 120-byte request switched
usage off for everyone (issue 45). A client's refused request now only asks for a probe: the
same route, the engine's first model, one token, streamed with the injection; only when the
engine refuses that naming `stream_options`, or compresses its answer, and takes the same
probe without it, is the refusal remembered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.admission import ADMISSION
from proxy.config import SETTINGS
from proxy.engines.call import bearer
from proxy.engines.queries import fetch_model_ids, read_limited
from proxy.logs import log_event
from proxy.observe import InjectionRefusals, names_stream_options
from proxy.observe.rules import EngineIdentity
from proxy.recorder import RECORDER
from proxy.upstream.pools import UPSTREAM_POOL
from proxy.upstream.resend import send_upstream

__all__ = ["INJECTION_PROBE", "InjectionProbe", "probe_body", "run_probe"]

log = logging.getLogger("cachewitness.forward")

# The statuses an engine refuses an unknown or misplaced field with (FastAPI's 422, plain 400).
REFUSED_STATUSES = frozenset({400, 422})
# At most one probe per this many seconds (or per reprobe bound, if shorter): each costs the
# engine two one-token requests, and a client can ask for one with every stream it sends.
PROBE_INTERVAL_S = 60.0
_READ_LIMIT = 64 * 1024
_TIMEOUT_S = 60.0


def probe_body(path: str, model: str, *, inject: bool) -> bytes:
    """The probe's request: a one-token stream on `path`, with or without `include_usage`."""
    body: dict[str, Any] = {"model": model, "max_tokens": 1, "temperature": 0, "stream": True}
    if path == "/v1/completions":
        body["prompt"] = "ping"
    else:
        body["messages"] = [{"role": "user", "content": "ping"}]
    if inject:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


async def _post(
    session: aiohttp.ClientSession, url: str, body: bytes, key: str | None
) -> tuple[int, str, bytes]:
    """Status, Content-Encoding and the first 64 KiB of one probe's answer; status 0 when none came."""
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity", **(bearer(key) or {})}
    timeout = aiohttp.ClientTimeout(total=_TIMEOUT_S)
    try:
        response = await send_upstream(
            session, "POST", url, data=body, headers=headers, timeout=timeout, allow_redirects=False
        )
        async with response:
            encoding = response.headers.get("Content-Encoding", "identity").lower()
            read = await read_limited(response, _READ_LIMIT)
            return response.status, encoding, read or b""
    except (TimeoutError, aiohttp.ClientError, OSError, RuntimeError):
        return 0, "identity", b""


async def run_probe(
    session: aiohttp.ClientSession,
    base: str,
    path: str,
    key: str | None,
    model: str | None = None,
    sending: Callable[[], None] = lambda: None,
) -> str | None:
    """Why the engine refuses the injection; None when it takes it or the probe cannot say.

    A refusal only when the injected probe alone fails: the same probe without it succeeds.
    The model is the engine's first at /v1/models, else `model` (the refused request's: only
    a string in the sidecar's own body, and a wrong one fails both ways). `sending` is told of
    each inference request before it goes.
    """
    model = next(iter(await fetch_model_ids(session, base, _TIMEOUT_S, key) or []), model)
    if model is None:
        return None
    sending()
    status, encoding, body = await _post(session, base + path, probe_body(path, model, inject=True), key)
    if 200 <= status < 300:
        return None if encoding == "identity" else "compressed an injected answer"
    if status not in REFUSED_STATUSES or not names_stream_options(body):
        return None
    sending()
    plain, _, _ = await _post(session, base + path, probe_body(path, model, inject=False), key)
    return "refused the injected include_usage" if 200 <= plain < 300 else None


class InjectionProbe:
    """Runs at most one probe at a time, at most one per interval, and remembers what it confirms."""

    def __init__(self, refusals: InjectionRefusals) -> None:
        """No probe run yet."""
        self.refusals = refusals
        self.interval_s = min(PROBE_INTERVAL_S, refusals.reprobe_s)
        self._last = float("-inf")
        self._pending: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.runs = 0

    def suspect(
        self, app: web.Application, info: EngineIdentity | None, path: str, model: str | None
    ) -> None:
        """A client's injected request was refused: probe the engine in the background, if due."""
        now = time.monotonic()
        if self._pending or self._stopping or now - self._last < self.interval_s:
            return
        self._last = now
        task = asyncio.get_running_loop().create_task(self._probe(app, info, path, model))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _probe(
        self, app: web.Application, info: EngineIdentity | None, path: str, model: str | None
    ) -> None:
        """One probe; a confirmed refusal is remembered for this engine."""
        settings = app[SETTINGS]
        pool, base, key = app[UPSTREAM_POOL], settings.upstream_base, settings.engine_key
        # Each probe is inference traffic the engine counts (and caches): the witnesses count it
        # as unobserved, not as a bypass of the sidecar.
        recorder, admission = app[RECORDER], app[ADMISSION]
        # Through the drain gate like client traffic: no probe reaches the engine while a
        # reset's canary needs it to itself.
        if not await admission.admit():
            self.runs += 1
            return
        try:
            refusal = await run_probe(pool, base, path, key, model, lambda: recorder.unobserved_request(None))
        finally:
            admission.leave()
        self.runs += 1
        if refusal is None:
            log_event(
                log, logging.INFO, "injection probe: the engine takes include_usage", event="injection_probe"
            )
            return
        self.refusals.remember(info)
        log_event(
            log,
            logging.INFO,
            f"injection probe: the engine {refusal}; "
            f"not injecting for this engine for {self.refusals.reprobe_s:g} s",
            event="injection_probe",
        )

    async def stop(self) -> None:
        """Cancel a probe in flight and start none after (before the pool closes)."""
        self._stopping = True
        for task in list(self._pending):
            task.cancel()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)


INJECTION_PROBE = web.AppKey("injection_probe", InjectionProbe)
