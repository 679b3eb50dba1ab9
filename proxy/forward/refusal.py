"""What a request must be for the sidecar to forward it unchanged; a clear 400 when it is not.

Two things cannot be forwarded as they came: an absolute-form target (`POST http://x/v1/...`,
RFC 9112 §3.2.2: a request for a forward proxy, which the sidecar is not) and a header value
whose bytes are not UTF-8 (aiohttp's client sends header values as UTF-8 only). The id
headers are the exception: they go on escaped (`proxy.forward.ids`). A third, a path whose
meaning engines could disagree on, is refused by the route policy before routing (`PATH_REFUSAL`).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from proxy.errors import error_response
from proxy.forward.ids import ID_HEADERS, is_utf8

__all__ = ["PATH_REFUSAL", "Refusal", "refusal"]


@dataclass(frozen=True)
class Refusal:
    """Why a request cannot be forwarded: the answer's code and message, and the header named."""

    code: str
    message: str
    header: str | None = None

    def response(self) -> web.Response:
        """The OpenAI-style 400 the client gets."""
        return error_response(
            400, self.message, type_="invalid_request_error", code=self.code, param=self.header
        )


# A path engines could read differently (proxy/admin/policy.py, decoded_path): the route
# policy answers this before any routing.
PATH_REFUSAL = Refusal(
    "invalid_request_target",
    "the request path holds a % escape after two rounds of percent-decoding, a %u escape, bytes that "
    "are not UTF-8 or control characters: engines decode such a path differently, so the sidecar does "
    "not forward it; percent-encode the path once, with %XX escapes only (RFC 3986)",
)


def refusal(request: web.Request) -> Refusal | None:
    """Why `request` cannot be forwarded unchanged, or None when it can."""
    if not request.raw_path.startswith("/"):
        return Refusal(
            "invalid_request_target",
            "the request target must be a path such as /v1/chat/completions (origin-form); "
            "the sidecar is not a forward proxy and does not take absolute URLs or other forms",
        )
    for name, value in request.headers.items():
        if name.lower() not in ID_HEADERS and not is_utf8(value):
            # The value itself is never echoed: it may be a credential.
            return Refusal(
                "invalid_header_encoding",
                f"the {name} header's value is not valid UTF-8, so the sidecar cannot forward it "
                "unchanged; send it as UTF-8 (ASCII for credentials)",
                header=name,
            )
    return None
