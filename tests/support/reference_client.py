"""The reference benchmark client's reset logic, restated for the compatibility tests.

The client (its `cache_state` module) posts an empty body to a reset URL with
`Authorization: Bearer <api key>`, reads the answer's `success` field, retries a refusal every
half second for `retry_seconds`, and writes an `infer.cache_state` record per case. This is that
logic in the client's own terms (stdlib only: urllib, no redirects, no environment proxy), so a
test can run it against the sidecar as the client would and compare the two records.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

ACKNOWLEDGED = "acknowledged"
REFUSED = "refused"
ACCEPTED_UNVERIFIED = "accepted_unverified"
RETRY_INTERVAL_S = 0.5
BODY_LIMIT = 64 * 1024


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


@dataclass(frozen=True)
class ClientReset:
    """The client's outcome of one reset, over all its attempts."""

    url: str
    at_ns: int
    status: int | None = None
    error: str | None = None
    success: bool | None = None
    attempts: int = 1
    answered_at_ns: int | None = None

    @property
    def answer(self) -> str | None:
        """acknowledged, refused or accepted_unverified; None without a 2xx."""
        if self.status is None or not 200 <= self.status < 300:
            return None
        if self.success is None:
            return ACCEPTED_UNVERIFIED
        return ACKNOWLEDGED if self.success else REFUSED

    @property
    def succeeded(self) -> bool:
        return self.answer in (ACKNOWLEDGED, ACCEPTED_UNVERIFIED)

    def to_record(self) -> dict[str, Any]:
        """The `reset` member of the client's record."""
        return {
            "url": self.url,
            "at_ns": self.at_ns,
            "status": self.status,
            "error": self.error,
            "success": self.success,
            "answer": self.answer,
            "attempts": self.attempts,
            "answered_at_ns": self.answered_at_ns,
        }


def _success_field(body: bytes) -> bool | None:
    try:
        payload = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(payload, dict) or "success" not in payload:
        return None
    return payload["success"] is True


def _post(url: str, at_ns: int, timeout_s: float, api_key: str | None) -> ClientReset:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(url, data=b"", headers=headers, method="POST")
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            success = _success_field(response.read(BODY_LIMIT))
            return ClientReset(
                url, at_ns, int(response.status), success=success, answered_at_ns=time.time_ns()
            )
    except urllib.error.HTTPError as exc:
        exc.close()  # its socket (the client leaves it to the garbage collector)
        return ClientReset(url, at_ns, exc.code, error=f"HTTP {exc.code}", answered_at_ns=time.time_ns())
    except OSError as exc:
        return ClientReset(url, at_ns, error=f"{type(exc).__name__}: {exc}", answered_at_ns=time.time_ns())


def reset_cache(
    url: str, *, timeout_s: float, api_key: str | None = None, retry_s: float = 10.0
) -> ClientReset:
    """POST to the reset URL; a refusal is retried every half second for `retry_s`; never raises."""
    at_ns = time.time_ns()
    deadline = time.monotonic() + retry_s
    attempts = 1
    reset = _post(url, at_ns, timeout_s, api_key)
    while reset.answer == REFUSED and deadline - time.monotonic() >= RETRY_INTERVAL_S:  # bounded by retry_s
        time.sleep(RETRY_INTERVAL_S)
        attempts += 1
        reset = _post(url, at_ns, timeout_s, api_key)
    error = f"refused: success false on {attempts} attempts" if reset.answer == REFUSED else reset.error
    return ClientReset(
        reset.url, reset.at_ns, reset.status, error, reset.success, attempts, reset.answered_at_ns
    )


def cache_state_record(*, session_id: str, case_id: str, reset: ClientReset) -> dict[str, Any]:
    """The client's `infer.cache_state` record of a cold case with no warm-up (its reason words)."""
    if not reset.succeeded:
        reason = f"the cache reset failed ({reset.error or reset.status})"
    elif reset.answer == ACKNOWLEDGED:
        reason = "the server acknowledged the cache reset, but no engine adapter can confirm it"
    else:
        reason = (
            f"the cache reset returned HTTP {reset.status} without saying "
            "whether it succeeded, and no engine adapter can confirm it"
        )
    return {
        "schema_version": 1,
        "event_type": "infer.cache_state",
        "session_id": session_id,
        "case_id": case_id,
        "requested": "cold",
        "reset": reset.to_record(),
        "attempted": True,
        "acknowledged": reset.answer == ACKNOWLEDGED,
        "verified": "unverified",
        "reason": reason,
        "run_kind": "cold_start" if reset.succeeded else "unspecified",
    }
