"""`cachewitness reset`: ask a sidecar for a reset; the exit code is the answer (docs/cli.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from proxy.cli.cluster_report import pod_table, worst_exit_code
from proxy.cli.http import (
    EXIT_ADMIN_REFUSED,
    EXIT_BAD_INPUT,
    EXIT_CODES,
    EXIT_FAILED,
    EXIT_SIDECAR_UNREACHABLE,
    OPENER,
    BadOption,
    admin_request,
    common_arguments,
    http_failure,
    sidecar_target,
    unreachable,
)

__all__ = ["add_reset_arguments", "run_reset"]


def add_reset_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `cachewitness reset`."""
    common_arguments(parser)
    parser.add_argument("--session-id", default=None, metavar="S", help="benchmark session id for the record")
    parser.add_argument("--case-id", default=None, metavar="C", help="benchmark case id for the record")
    parser.add_argument(
        "--requested",
        choices=("cold", "unspecified"),
        default=None,
        help="cache state the case asks for (default cold)",
    )
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=None,
        metavar="N",
        help="warm-up requests the case runs before measuring",
    )
    parser.add_argument("--no-drain", action="store_true", help="do not hold traffic while resetting")
    parser.add_argument(
        "--retry-seconds",
        type=float,
        default=None,
        metavar="N",
        help="keep retrying a refused reset for N seconds (0..120)",
    )
    parser.add_argument(
        "--force", action="store_true", help="vLLM: reset_running_requests=true (preempts running requests)"
    )
    parser.add_argument(
        "--verify",
        choices=("canary", "none"),
        default=None,
        help="prove the reset with a canary (the sidecar's default) or not",
    )
    parser.add_argument(
        "--bind",
        action="store_true",
        help="only requests carrying the answer's case_token (header X-Cachewitness-Case) decide the verdict",
    )
    parser.add_argument(
        "--isolation",
        choices=("none", "request"),
        default=None,
        help="request: every request of the case (X-Session-Id/X-Case-Id) is isolated from the prefix "
        "cache and proven cold until the case's next reset (needs --case-id)",
    )
    parser.add_argument("--json", action="store_true", help="print the answer's JSON body")


def _reset_body(ns: argparse.Namespace) -> dict[str, Any]:
    """The JSON body of the reset call: only what the user gave."""
    body: dict[str, Any] = {}
    for name in (
        "session_id",
        "case_id",
        "requested",
        "warmup_requests",
        "retry_seconds",
        "verify",
        "isolation",
    ):
        value = getattr(ns, name, None)
        if value is not None:
            body[name] = value
    if ns.no_drain:
        body["drain"] = False
    if ns.force:
        body["force"] = True
    if getattr(ns, "bind", False):
        body["bind"] = True
    if ns.scope == "cluster":
        body["scope"] = "cluster"
    return body


# The answers a witness speaks to (the others are failures the detail explains).
_PROVABLE = frozenset({"acknowledged", "accepted_unverified", "contradicted"})


def _human_line(answer: dict[str, Any]) -> str:
    """One readable line: answer, attempts, engine, and the hint or warning."""
    engine = answer.get("engine") or {}
    kind = engine.get("kind") or "?"
    version = f" {engine['version']}" if engine.get("version") else ""
    attempts = answer.get("attempts")
    parts = [
        f"{answer.get('answer')}: engine {kind}{version}",
        f"{attempts} attempt{'s' if attempts != 1 else ''}",
        f"reset_id {answer.get('reset_id')}",
    ]
    drain = answer.get("drain") or {}
    if drain.get("enabled"):
        parts.append(
            f"drained {drain.get('inflight_at_start', 0)} in flight in {drain.get('waited_s', 0):.2f}s"
        )
    if answer.get("verified") and answer.get("answer") in _PROVABLE:
        # A reset that failed has nothing to prove: its detail says why, once.
        parts.append(f"{answer['verified']} ({(answer.get('verification') or {}).get('reason')})")
    if answer.get("isolation") == "request":
        parts.append("the case's requests are isolated until its next reset")
    if answer.get("bind") and answer.get("case_token"):
        # The caller asked to bind: its benchmark must send this token, so it is shown.
        parts.append(f"case_token {answer['case_token']} (send it as X-Cachewitness-Case)")
    line = ", ".join(parts)
    for key in ("detail", "hint", "warning"):
        if answer.get(key):
            line += f"; {key}: {answer[key]}"
    return line


def run_reset(ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    """POST /cache/reset; print the answer; exit by answer, or 2/8/9 (see EXIT_* and docs/cli.md)."""
    env = os.environ if env is None else env
    try:
        base, token = sidecar_target(ns, env)
    except BadOption as bad:
        print(f"cachewitness reset: {bad}", file=sys.stderr)
        return EXIT_BAD_INPUT
    url = f"{base}/cache/reset"
    request = admin_request(url, token, data=json.dumps(_reset_body(ns)).encode())
    try:
        with OPENER.open(request, timeout=ns.timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (OSError, ValueError) as exc:
        return unreachable("reset", base, exc)
    try:
        answer = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        answer = None
    if not isinstance(answer, dict) or "answer" not in answer:
        return http_failure("reset", status, raw, url)
    if ns.json:
        print(json.dumps(answer, indent=2))
    elif answer.get("scope") == "cluster":
        print(pod_table(answer))
    else:
        print(_human_line(answer))
    if answer.get("scope") == "cluster":
        return worst_exit_code(answer, _pod_exit_code, EXIT_FAILED)
    return EXIT_CODES.get(str(answer["answer"]), EXIT_FAILED)


def _pod_exit_code(pod: Mapping[str, Any]) -> int:
    """One pod of a cluster reset as if reset alone: its answer's code, 8 not reached, 9 token refused."""
    if pod.get("status") is None:
        return EXIT_SIDECAR_UNREACHABLE
    if pod.get("status") in (401, 403):
        return EXIT_ADMIN_REFUSED
    return EXIT_CODES.get(str(pod.get("answer")), EXIT_FAILED)
