"""Client commands: `cachewitness reset` (exit code = the answer) and `cachewitness evidence`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from typing import IO, Any

from proxy.cli.cluster_report import pod_table, unreadable_pods, worst_exit_code
from proxy.evidence.summary import summarize, summary_table
from proxy.redact import redact_url
from proxy.vocabulary import EventType

__all__ = [
    "EXIT_ADMIN_REFUSED",
    "EXIT_BAD_INPUT",
    "EXIT_CODES",
    "EXIT_FAILED",
    "EXIT_SIDECAR_UNREACHABLE",
    "add_evidence_arguments",
    "add_reset_arguments",
    "run_evidence",
    "run_reset",
]

DEFAULT_URL = "http://127.0.0.1:9000"
# SPEC §2: the exit code says the answer.
EXIT_CODES = {
    "acknowledged": 0,
    "accepted_unverified": 3,
    "refused": 4,
    "unsupported": 5,
    "unreachable": 6,
    "error": 6,
    # SPEC §12.1: a reset the canary contradicted.
    "contradicted": 7,
    # A cluster reset that could not reach every pod.
    "partial": 6,
}
# The exit codes that are not an answer (docs/cli.md, "Exit codes", has the whole table).
EXIT_BAD_INPUT = 2  # a bad option, an unreadable --token-file, input the sidecar rejected (400)
EXIT_FAILED = 6  # the engine unreachable, or another error the sidecar reported
EXIT_SIDECAR_UNREACHABLE = 8  # no sidecar answer at --url (refused, timeout, or not a sidecar's reply)
EXIT_ADMIN_REFUSED = 9  # the sidecar refused the admin token (401) or this client (403)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Admin calls never follow redirects (a token must not travel elsewhere)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        """Refuse every redirect."""
        return None


# No environment proxy between the client and its sidecar, and no redirects.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _exit_code_help() -> str:
    """The exit codes in one line, from the same constants the commands return (docs/cli.md has the table)."""
    answers: dict[int, list[str]] = {}
    for answer, code in EXIT_CODES.items():
        answers.setdefault(code, []).append(answer)
    words = {code: "/".join(names) for code, names in answers.items()}
    words[EXIT_FAILED] = "engine unreachable or another error (" + words.get(EXIT_FAILED, "") + ")"
    words[EXIT_BAD_INPUT] = "bad input"
    words[EXIT_SIDECAR_UNREACHABLE] = "sidecar unreachable"
    words[EXIT_ADMIN_REFUSED] = "admin token refused"
    return "exit codes: " + ", ".join(f"{code} {words[code]}" for code in sorted(words))


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    """--url, --token-file, --timeout: where the sidecar is and how to be let in."""
    parser.epilog = _exit_code_help()
    parser.add_argument(
        "--url",
        default=None,
        metavar="SIDECAR_URL",
        help=f"the sidecar's base URL (env CACHEWITNESS_URL; default {DEFAULT_URL})",
    )
    parser.add_argument(
        "--token-file",
        default=None,
        metavar="F",
        help="file holding the admin token (else env CACHEWITNESS_ADMIN_TOKEN)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds to wait for the sidecar's answer (default 300)",
    )
    parser.add_argument(
        "--scope",
        choices=("pod", "cluster"),
        default="pod",
        help="this sidecar's engine (default), or every peer's (the sidecar's peers / peers_dns)",
    )


def add_reset_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `cachewitness reset`."""
    _common_arguments(parser)
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
    parser.add_argument("--json", action="store_true", help="print the answer's JSON body")


def add_evidence_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `cachewitness evidence`."""
    _common_arguments(parser)
    parser.add_argument("--session-id", default=None, metavar="S")
    parser.add_argument("--case-id", default=None, metavar="C")
    parser.add_argument(
        "--event-type",
        default=None,
        metavar="T",
        help="infer.cache_state, infer.cache_observation or infer.cache_verification",
    )
    parser.add_argument(
        "--since-ns", type=int, default=None, metavar="NS", help="records at or after this time"
    )
    parser.add_argument(
        "--summary", action="store_true", help="print a table per (session, case) instead of the records"
    )


def _base_url(ns: argparse.Namespace, env: Mapping[str, str]) -> str:
    """--url, else CACHEWITNESS_URL, else the default; without a trailing slash."""
    return (ns.url or env.get("CACHEWITNESS_URL") or DEFAULT_URL).rstrip("/")


def _token(ns: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """The admin token from --token-file, else CACHEWITNESS_ADMIN_TOKEN; raises OSError for an unreadable file."""
    if ns.token_file:
        with open(ns.token_file, encoding="utf-8") as handle:
            return handle.read().strip() or None
    return env.get("CACHEWITNESS_ADMIN_TOKEN") or None


def _request(url: str, token: str | None, *, data: bytes | None = None) -> urllib.request.Request:
    """A request to the sidecar with the admin token, if any."""
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if data is not None:
        headers["Content-Type"] = "application/json"
    return urllib.request.Request(
        url, data=data, headers=headers, method="POST" if data is not None else "GET"
    )


def _sidecar_error(body: bytes) -> str | None:
    """The message of an OpenAI-style error body (what the sidecar sends), else None."""
    try:
        payload = json.loads(body.decode("utf-8"))
        return str(payload["error"]["message"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, else its start."""
    message = _sidecar_error(body)
    if message is not None:
        return message
    return body[:300].decode("utf-8", errors="replace").strip() or "(no body)"


def _unreachable(command: str, base: str, exc: BaseException) -> int:
    """No HTTP answer at all from --url: say so, exit EXIT_SIDECAR_UNREACHABLE."""
    reason = getattr(exc, "reason", exc)
    print(
        f"cachewitness {command}: the sidecar at {redact_url(base)} cannot be reached: {reason}; "
        "check --url (or CACHEWITNESS_URL)",
        file=sys.stderr,
    )
    return EXIT_SIDECAR_UNREACHABLE


def _http_failure(command: str, status: int, raw: bytes, url: str) -> int:
    """An HTTP error without a reset answer: say why in one line and pick the exit code."""
    message = _sidecar_error(raw)
    shown = message if message is not None else _error_message(raw)
    if status == 401:
        why = f"the sidecar refused the admin token (401: {shown}); pass --token-file or set CACHEWITNESS_ADMIN_TOKEN"
        code = EXIT_ADMIN_REFUSED
    elif status == 403:
        why, code = f"the sidecar refused this client (403: {shown})", EXIT_ADMIN_REFUSED
    elif status == 400:
        why, code = f"the sidecar rejected the input: {shown}", EXIT_BAD_INPUT
    elif message is not None:
        why, code = f"HTTP {status} from {redact_url(url)}: {message}", EXIT_FAILED
    else:
        # Not the sidecar's error shape: something else answers at that URL (a proxy's 502, a 404).
        why = f"HTTP {status} from {redact_url(url)} is not a cachewitness answer ({shown}); check --url"
        code = EXIT_SIDECAR_UNREACHABLE
    print(f"cachewitness {command}: {why}", file=sys.stderr)
    return code


def _reset_body(ns: argparse.Namespace) -> dict[str, Any]:
    """The JSON body of the reset call: only what the user gave."""
    body: dict[str, Any] = {}
    for name in ("session_id", "case_id", "requested", "warmup_requests", "retry_seconds", "verify"):
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
    if answer.get("verified"):
        parts.append(f"{answer['verified']} ({(answer.get('verification') or {}).get('reason')})")
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
    base = _base_url(ns, env)
    try:
        token = _token(ns, env)
    except OSError as exc:
        print(
            f"cachewitness reset: cannot read --token-file {ns.token_file}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    url = f"{base}/cache/reset"
    request = _request(url, token, data=json.dumps(_reset_body(ns)).encode())
    try:
        with _OPENER.open(request, timeout=ns.timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (OSError, ValueError) as exc:
        return _unreachable("reset", base, exc)
    try:
        answer = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        answer = None
    if not isinstance(answer, dict) or "answer" not in answer:
        return _http_failure("reset", status, raw, url)
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


def _evidence_url(ns: argparse.Namespace, base: str) -> str:
    """GET /cache/evidence with the filters the user gave."""
    query = {
        name: str(value)
        for name, value in (
            ("session_id", ns.session_id),
            ("case_id", ns.case_id),
            ("event_type", ns.event_type),
            ("since_ns", ns.since_ns),
            ("scope", "cluster" if ns.scope == "cluster" else None),
        )
        if value is not None
    }
    return f"{base}/cache/evidence" + (f"?{urllib.parse.urlencode(query)}" if query else "")


def _records(lines: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    """Decode JSON lines, skipping any that are not JSON objects."""
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield record


def run_evidence(
    ns: argparse.Namespace, env: Mapping[str, str] | None = None, out: IO[bytes] | None = None
) -> int:
    """Stream GET /cache/evidence to stdout, or print a per-case summary table; 0, or 2/6/8/9 (EXIT_*)."""
    env = os.environ if env is None else env
    base = _base_url(ns, env)
    try:
        token = _token(ns, env)
    except OSError as exc:
        print(
            f"cachewitness evidence: cannot read --token-file {ns.token_file}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    sink = out if out is not None else sys.stdout.buffer
    # With scope cluster, the last line names the pods that could not be read.
    trailers: list[dict[str, Any]] = []
    url = _evidence_url(ns, base)
    try:
        with _OPENER.open(_request(url, token), timeout=ns.timeout) as response:
            if ns.summary:
                records = list(_records(iter(response.readline, b"")))
                trailers = [r for r in records if r.get("event_type") == EventType.CLUSTER_READ]
                cases = summarize(r for r in records if r.get("event_type") != EventType.CLUSTER_READ)
                sink.write(summary_table(cases).encode("utf-8") + b"\n")
            else:
                for line in iter(response.readline, b""):  # bounded by the response's end
                    sink.write(line)
                    if EventType.CLUSTER_READ.encode() in line:
                        trailers.extend(_records(iter([line])))
            sink.flush()
    except urllib.error.HTTPError as exc:
        return _http_failure("evidence", exc.code, exc.read(), url)
    except BrokenPipeError:
        return 0  # the reader (e.g. `head`) has had enough
    except (OSError, ValueError) as exc:
        return _unreachable("evidence", base, exc)
    missing = unreadable_pods(trailers)
    if missing:
        print(f"cachewitness evidence: pods not read: {'; '.join(missing)}", file=sys.stderr)
        return EXIT_FAILED
    return 0
