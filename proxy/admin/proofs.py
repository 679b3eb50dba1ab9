"""`GET /cache/evidence?proof=inclusion|consistency`: the Merkle proofs (docs/evidence.md).

`inclusion` streams each matching record with its leaf index and audit path to a signed
checkpoint, the checkpoints, and the consistency proofs between them (proxy/evidence/inclusion.py);
`consistency&from=S1&to=S2[&file=F]` answers one JSON object: the proof between two checkpoints
of one writer life, named by their `seq`.
"""

from __future__ import annotations

import re
from contextlib import aclosing
from typing import Any

from aiohttp import web

from proxy.errors import error_response
from proxy.evidence.inclusion import ConsistencyError
from proxy.evidence.log import EVIDENCE

__all__ = ["consistency_proof", "inclusion_proof"]

_SEQ = re.compile(r"[0-9]{1,20}")


def _bad(param: str, message: str) -> web.Response:
    return error_response(400, message, type_="invalid_request_error", code="invalid_filter", param=param)


async def inclusion_proof(request: web.Request, filters: dict[str, Any]) -> web.StreamResponse:
    """Stream the inclusion proofs of the records matching `filters`."""
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    async with aclosing(request.app[EVIDENCE].inclusion(**filters)) as stream:
        async for data in stream:
            await response.write(data)
    await response.write_eof()
    return response


async def consistency_proof(request: web.Request) -> web.Response:
    """The consistency proof between the checkpoints `from` and `to` (seqs) of `file`."""
    query = request.query
    seqs = []
    for name in ("from", "to"):
        text = query.get(name)
        if text is None or not _SEQ.fullmatch(text):
            return _bad(name, f"proof=consistency needs {name}: a checkpoint's seq (ASCII digits)")
        seqs.append(int(text))
    try:
        answer = await request.app[EVIDENCE].consistency(query.get("file"), seqs[0], seqs[1])
    except ConsistencyError as exc:
        param = "file" if str(exc).startswith("file") else "from"
        return _bad(param, str(exc))
    return web.json_response(answer)
