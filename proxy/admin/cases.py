"""`POST /cache/cases/{case_id}/close`: the case ends now; its engine counters are read and reconciled."""

from __future__ import annotations

import orjson
from aiohttp import web

from proxy.errors import error_response
from proxy.recorder import RECORDER

__all__ = ["handle_case_close"]


async def handle_case_close(request: web.Request) -> web.Response:
    """200 with the `infer.cache_reconciliation` record, or 404 when `case_id` is not the open case."""
    case = request.app[RECORDER].case
    case_id = request.match_info["case_id"]
    done = await case.close(case_id) if case is not None else None
    if done is None:
        return error_response(
            404,
            f"no open case {case_id!r}",
            type_="invalid_request_error",
            code="case_not_open",
            param="case_id",
        )
    return web.Response(body=orjson.dumps(done.to_record()), content_type="application/json")
