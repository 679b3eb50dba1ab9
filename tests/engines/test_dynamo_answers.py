"""Dynamo's `/clear_kv_blocks` answers, read from bytes: HTTP 200 acknowledges only when every worker says success.

Shapes from ai-dynamo/dynamo lib/llm/src/http/service/clear_kv_blocks.rs: each worker's `response`
is its first answer serialised to a JSON string; `failed_workers` lists workers not reached.
"""

from __future__ import annotations

import orjson
import pytest

from proxy.engines.call import EngineCall, Reply
from proxy.engines.dynamo import read_clear
from proxy.vocabulary import ResetAnswer

OK = '{"message":"KV cache cleared","status":"success"}'
REFUSED = '{"message":"KV cache reset failed","status":"error"}'
URL = "http://127.0.0.1:8000/clear_kv_blocks"


def reply(body: object, status: int = 200) -> Reply:
    """A reply carrying `body` (JSON-encoded unless bytes)."""
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return Reply(EngineCall("POST", URL, status, raw.decode(), 0.01), raw)


def worker(n: int, response: object) -> dict[str, object]:
    """A `cleared_workers` entry."""
    return {
        "name": f"dynamo/backend-instance-{n}",
        "endpoint": "dynamo/backend/clear_kv_blocks",
        "response": response,
    }


def test_every_worker_answering_success_acknowledges() -> None:
    attempt = read_clear(reply({"cleared_workers": [worker(1, OK), worker(2, OK)], "failed_workers": []}))
    assert (attempt.outcome, attempt.success, attempt.status) == (ResetAnswer.ACKNOWLEDGED, True, 200)


def test_a_worker_answer_given_as_an_object_is_read_too() -> None:
    body = {"cleared_workers": [worker(1, {"status": "success", "message": "KV cache cleared"})]}
    assert read_clear(reply(body)).outcome == ResetAnswer.ACKNOWLEDGED


def test_a_worker_whose_engine_refused_is_a_refusal_though_the_status_is_200() -> None:
    attempt = read_clear(
        reply({"cleared_workers": [worker(1, OK), worker(2, REFUSED)], "failed_workers": []})
    )
    assert (attempt.outcome, attempt.success, attempt.status) == (ResetAnswer.REFUSED, False, 200)
    assert attempt.error == "partial: 1 of 2 workers cleared; 1 refused (dynamo/backend-instance-2)"


def test_a_worker_not_reached_is_a_partial_refusal() -> None:
    failed = {"name": "dynamo/backend-instance-3", "status": "Failed to send request for instance"}
    attempt = read_clear(reply({"cleared_workers": [worker(1, OK)], "failed_workers": [failed]}))
    assert attempt.outcome == ResetAnswer.REFUSED
    assert attempt.error == "partial: 1 of 2 workers cleared; 1 not reached (dynamo/backend-instance-3)"


def test_nothing_cleared_anywhere_is_not_called_partial() -> None:
    attempt = read_clear(reply({"cleared_workers": [worker(1, REFUSED)], "failed_workers": []}))
    assert attempt.outcome == ResetAnswer.REFUSED and attempt.error is not None
    assert not attempt.error.startswith("partial")


@pytest.mark.parametrize("response", ["", "not json", '{"message":"x"}', None, 7])
def test_a_worker_answer_that_does_not_say_success_is_no_success(response: object) -> None:
    assert read_clear(reply({"cleared_workers": [worker(1, response)]})).outcome == ResetAnswer.REFUSED


@pytest.mark.parametrize("message", ["No active worker groups found", "Distributed runtime not available"])
def test_a_frontend_that_found_no_worker_cleared_nothing(message: str) -> None:
    attempt = read_clear(reply({"message": message}))
    assert attempt.outcome == ResetAnswer.REFUSED
    assert attempt.error == f"no worker was cleared: {message}"


def test_many_workers_are_named_within_bounds() -> None:
    failed = [{"name": f"w{i}"} for i in range(50)]
    attempt = read_clear(reply({"cleared_workers": [], "failed_workers": failed}))
    assert attempt.error == "50 not reached (w0, w1, w2, w3 and 46 more)"


@pytest.mark.parametrize(
    ("body", "status", "outcome"),
    [
        (
            b'{"message":"Route not found: POST /clear_kv_blocks","type":"Not Found","code":404}',
            404,
            "unsupported",
        ),
        (b"", 500, "error"),
        (b"[1, 2]", 200, "error"),
        (b'{"cleared_workers": "all"}', 200, "error"),
    ],
)
def test_other_answers(body: bytes, status: int, outcome: str) -> None:
    assert read_clear(reply(body, status)).outcome == outcome
