"""The case routes: `POST /cache/cases/{case_id}/close` (the case ends now; its engine counters are
read and reconciled) and `POST /cache/cases/{case_id}/isolate` (its requests isolated from now on)."""

from __future__ import annotations

import orjson
from aiohttp import web

from proxy.errors import error_response
from proxy.recorder import RECORDER
from proxy.reset.params import BadInput, is_valid_id, read_session_id

__all__ = ["handle_case_close", "handle_case_isolate"]


async def handle_case_close(request: web.Request) -> web.Response:
    """200 with the `infer.cache_reconciliation` record (and the `infer.cache_isolation` records of the
    case's isolated requests, `isolation`), or 404 when `case_id` is neither the open case nor isolated."""
    recorder = request.app[RECORDER]
    case, case_id, isolation = recorder.case, request.match_info["case_id"], recorder.isolation
    mark = isolation.written
    done = await case.close(case_id) if case is not None else None
    # The reconciliation ends its own session's tally with the engine's counters; then the others.
    isolation.close(None, case_id)
    isolated = isolation.written_since(mark, case_id)
    if done is None and not isolated:
        return error_response(
            404,
            f"no open case {case_id!r}",
            type_="invalid_request_error",
            code="case_not_open",
            param="case_id",
        )
    body = done.to_record() if done is not None else {"case_id": case_id}
    if isolated:
        body = {**body, "isolation": isolated}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def handle_case_isolate(request: web.Request) -> web.Response:
    """Isolate the case's requests from the prefix cache until its next reset, without a reset.

    `session_id` (optional, in the JSON body or the query) narrows it to one session's case.
    """
    case_id = request.match_info["case_id"]
    if not is_valid_id(case_id):
        return error_response(
            400,
            "case_id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -",
            type_="invalid_request_error",
            code="invalid_value",
            param="case_id",
        )
    try:
        session_id = await read_session_id(request)
    except BadInput as bad:
        return error_response(400, bad.message, type_="invalid_request_error", code=bad.code, param=bad.param)
    isolation = request.app[RECORDER].isolation
    isolation.isolate(session_id, case_id)
    body = {"session_id": session_id, "case_id": case_id, "isolation": "request"}
    return web.Response(body=orjson.dumps(body), content_type="application/json")
