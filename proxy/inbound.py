"""What a request must be for the sidecar to forward it unchanged; a clear 400 when it is not.

Two things cannot be forwarded as they came: an absolute-form target (`POST http://x/v1/...`,
RFC 9112 §3.2.2: a request for a forward proxy, which the sidecar is not) and a header value
whose bytes are not UTF-8 (aiohttp's client sends header values as UTF-8 only). The id
headers are the exception: they go on escaped (`proxy.request_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from proxy.errors import error_response
from proxy.request_ids import ID_HEADERS, is_utf8

__all__ = ["Refusal", "refusal"]


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
