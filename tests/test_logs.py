"""What a log shipper reads from a running sidecar: JSON log lines on stderr, evidence records on stdout."""

from __future__ import annotations

import asyncio
import io
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.logs import JsonFormatter
from proxy.sim import running_sim
from tests.support.client import CLIENT_TIMEOUT
from tests.support.evidence_files import CHAIN_EVENTS, resets_file
from tests.support.process import wait_status
from tests.support.sidecar import free_port
from tests.support.sim import chat, fast, words

BASE_KEYS = ["ts", "level", "logger", "msg"]
TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
EVIDENCE_KEYS = {"schema_version", "event_type", "at_ns", "session_id", "case_id"}
# A writer's own lines (its opening, its checkpoints) belong to no case: they carry the chain instead.
CHAIN_KEYS = {"schema_version", "event_type", "at_ns", "writer_id", "seq", "prev"}


def _objects(text: str) -> list[dict[str, Any]]:
    """Each line as a JSON object (fails, naming the line, on one that is not)."""
    objects = []
    for line in text.splitlines():
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError as error:
            raise AssertionError(f"not a JSON line: {line!r}") from error
        assert isinstance(value, dict), line
        objects.append(value)
    return objects


async def _serve(upstream: str, tmp_path: Path) -> tuple[asyncio.subprocess.Process, str]:
    """`python -m proxy serve --evidence-stdout`, stdout and stderr each to its own file; ready."""
    port = free_port()
    with open(tmp_path / "stdout", "wb") as out, open(tmp_path / "stderr", "wb") as err:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--upstream", upstream, "--listen", f"127.0.0.1:{port}",
            "--evidence", str(tmp_path / "ev.jsonl"), "--evidence-stdout", "--health-interval", "0.2",
            stdout=out, stderr=err,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
        while True:
            try:
                await wait_status(http, url + "/-/ready", 200, bound_s=30)
                return process, url
            except aiohttp.ClientConnectionError:
                assert process.returncode is None and loop.time() < deadline, (
                    tmp_path / "stderr"
                ).read_text()
                await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_sidecar_logs_json_on_stderr_and_evidence_json_on_stdout(tmp_path: Path) -> None:
    """A request, a reset, the engine going away and a SIGTERM: every stderr line is a JSON object
    starting with ts, level, logger, msg; every stdout line is an evidence record, nothing else."""
    async with running_sim(fast("vllm")) as engine:
        process, url = await _serve(engine, tmp_path)
        try:
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
                async with http.post(f"{url}/v1/chat/completions", json=chat(words(40))) as resp:
                    assert resp.status == 200
                async with http.post(f"{url}/cache/reset", json={"session_id": "s", "case_id": "c"}) as resp:
                    assert resp.status == 200
        except BaseException:
            process.kill()
            raise
    try:  # the engine is gone: the sidecar logs it
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
            await wait_status(http, url + "/-/ready", 503)
    finally:
        process.terminate()
        assert await asyncio.wait_for(process.wait(), timeout=60) == 0
    lines = _objects((tmp_path / "stderr").read_text())
    for line in lines:
        assert list(line)[:4] == BASE_KEYS, line
        assert TS.fullmatch(line["ts"]) and line["level"] in {"debug", "info", "warning", "error", "critical"}
        assert line["logger"].startswith("cachewitness"), line
    events = {line.get("event") for line in lines}
    assert {"cache_reset"} <= events, events
    (reset,) = [line for line in lines if line.get("event") == "cache_reset"]
    assert reset["answer"] == "acknowledged" and reset["level"] == "info"
    assert any(line["level"] == "warning" and "upstream" in line["msg"] for line in lines), lines
    records = _objects((tmp_path / "stdout").read_text())
    assert {record["event_type"] for record in records} >= {"infer.cache_observation", "infer.cache_state"}
    assert {record["event_type"] for record in records} >= CHAIN_EVENTS  # the opening, the final checkpoint
    for record in records:
        assert set(record) >= (CHAIN_KEYS if record["event_type"] in CHAIN_EVENTS else EVIDENCE_KEYS), record
    # stdout carries the lines of both evidence files (observations, reset records), byte for byte.
    written = (tmp_path / "ev.jsonl").read_bytes() + resets_file(tmp_path / "ev.jsonl").read_bytes()
    assert sorted((tmp_path / "stdout").read_bytes().splitlines()) == sorted(written.splitlines())


def test_a_field_never_replaces_the_four_keys() -> None:
    """An event field named like a base key (ts, level, logger) is dropped, not written over it."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("cachewitness.test_logs")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.info("hello", extra={"event": "greeting", "level": "spoofed", "ts": "never", "logger": "other"})
    (line,) = _objects(stream.getvalue())
    assert list(line) == [*BASE_KEYS, "event"]
    assert (line["level"], line["logger"], line["msg"], line["event"]) == (
        "info", "cachewitness.test_logs", "hello", "greeting",
    )  # fmt: skip
    assert TS.fullmatch(line["ts"])


def test_library_logs_and_python_warnings_are_json_lines_too() -> None:
    """After setup_logging, a library's warning, a Python warning and asyncio's report of a lost
    task exception come out as the same JSON objects, not as logging's plain-text last resort."""
    code = (
        "import asyncio, gc, logging, warnings\n"
        "from proxy.logs import setup_logging\n"
        "setup_logging('info')\n"
        "logging.getLogger('somelib').warning('a library says %s', 'hi')\n"
        "warnings.warn('deprecated thing')\n"
        "async def boom():\n"
        "    raise RuntimeError('lost')\n"
        "async def main():\n"
        "    asyncio.get_running_loop().create_task(boom())\n"
        "    await asyncio.sleep(0.05)\n"
        "asyncio.run(main())\n"
        "gc.collect()\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    lines = _objects(run.stderr)
    assert [line["logger"] for line in lines] == ["somelib", "py.warnings", "asyncio"], lines
    for line in lines:
        assert list(line)[:4] == BASE_KEYS and line["level"] in {"warning", "error"}, line
    assert run.stdout == ""
