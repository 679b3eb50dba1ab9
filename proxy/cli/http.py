"""What `cachewitness reset` and `evidence` share: the sidecar URL and token, the admin request, the exit codes."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from proxy.redact import redact_url
from proxy.vocabulary import ResetAnswer

__all__ = [
    "DEFAULT_URL",
    "EXIT_ADMIN_REFUSED",
    "EXIT_BAD_INPUT",
    "EXIT_CODES",
    "EXIT_FAILED",
    "EXIT_SIDECAR_UNREACHABLE",
    "OPENER",
    "BadOption",
    "BadUrl",
    "admin_request",
    "base_url",
    "common_arguments",
    "error_message",
    "exit_code_help",
    "http_failure",
    "read_token",
    "sidecar_error",
    "sidecar_target",
    "unreachable",
]

DEFAULT_URL = "http://127.0.0.1:8000"


# The exit code says the answer (docs/cli.md).
EXIT_CODES: dict[str, int] = {
    ResetAnswer.ACKNOWLEDGED: 0,
    ResetAnswer.ACCEPTED_UNVERIFIED: 3,
    ResetAnswer.REFUSED: 4,
    ResetAnswer.UNSUPPORTED: 5,
    ResetAnswer.UNREACHABLE: 6,
    ResetAnswer.ERROR: 6,
    # A reset the canary contradicted (docs/reset.md).
    ResetAnswer.CONTRADICTED: 7,
    # A cluster reset that could not reach every pod.
    ResetAnswer.PARTIAL: 6,
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
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def exit_code_help() -> str:
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


def common_arguments(parser: argparse.ArgumentParser) -> None:
    """--url, --token-file, --timeout: where the sidecar is and how to be let in."""
    parser.epilog = exit_code_help()
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


class BadUrl(ValueError):
    """A sidecar URL that is not http(s)://HOST[:PORT][/PATH]: bad input (exit 2), with the fix."""


def base_url(ns: argparse.Namespace, env: Mapping[str, str]) -> str:
    """--url, else CACHEWITNESS_URL, else the default; without a trailing slash. Raises BadUrl."""
    url = (ns.url or env.get("CACHEWITNESS_URL") or DEFAULT_URL).rstrip("/")
    given = "--url" if ns.url else "CACHEWITNESS_URL"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        # `127.0.0.1:18000` parses as scheme "127.0.0.1": name the URL the user meant.
        shown = redact_url(url)
        raise BadUrl(f"{given} {shown} is not an http(s) URL; did you mean http://{shown.split('://')[-1]}?")
    return url


def read_token(ns: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """The admin token from --token-file, else CACHEWITNESS_ADMIN_TOKEN; raises OSError for an unreadable file."""
    if ns.token_file:
        with open(ns.token_file, encoding="utf-8") as handle:
            return handle.read().strip() or None
    return env.get("CACHEWITNESS_ADMIN_TOKEN") or None


class BadOption(ValueError):
    """The sidecar's URL or the admin token's file unusable: bad input (exit 2), the message says which."""


def sidecar_target(ns: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, str | None]:
    """The sidecar's base URL and the admin token, as every client command reads them; BadOption if not."""
    try:
        base = base_url(ns, env)
    except BadUrl as bad:
        raise BadOption(str(bad)) from bad
    try:
        token = read_token(ns, env)
    except OSError as exc:
        raise BadOption(f"cannot read --token-file {ns.token_file}: {exc.strerror or exc}") from exc
    return base, token


def admin_request(url: str, token: str | None, *, data: bytes | None = None) -> urllib.request.Request:
    """A request to the sidecar with the admin token, if any."""
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if data is not None:
        headers["Content-Type"] = "application/json"
    return urllib.request.Request(
        url, data=data, headers=headers, method="POST" if data is not None else "GET"
    )


def sidecar_error(body: bytes) -> str | None:
    """The message of an OpenAI-style error body (what the sidecar sends), else None."""
    try:
        payload = json.loads(body.decode("utf-8"))
        return str(payload["error"]["message"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None


def error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, else its start."""
    message = sidecar_error(body)
    if message is not None:
        return message
    return body[:300].decode("utf-8", errors="replace").strip() or "(no body)"


def unreachable(command: str, base: str, exc: BaseException) -> int:
    """No HTTP answer at all from --url: say so, exit EXIT_SIDECAR_UNREACHABLE."""
    reason = getattr(exc, "reason", exc)
    print(
        f"cachewitness {command}: the sidecar at {redact_url(base)} cannot be reached: {reason}; "
        "check --url (or CACHEWITNESS_URL)",
        file=sys.stderr,
    )
    return EXIT_SIDECAR_UNREACHABLE


def http_failure(command: str, status: int, raw: bytes, url: str) -> int:
    """An HTTP error without a reset answer: say why in one line and pick the exit code."""
    message = sidecar_error(raw)
    shown = message if message is not None else error_message(raw)
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
