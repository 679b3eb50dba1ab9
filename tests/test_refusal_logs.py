"""Refused requests are counted, and logged at most once per reason per 10 s (issue 27, L4).

One warning line per refused control request let a client write the log as fast as it could
send. Through `python -m proxy serve`: N refusals give every one in the metric, and a bounded
number of log lines whose `refused` counts add up to no more than N.
"""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import orjson
from yarl import URL

from proxy.sim import running_sim
from tests.support.client import CLIENT_TIMEOUT
from tests.support.process import scrape_fresh, start_sidecar, stop
from tests.support.sim import fast

REFUSALS = 200  # per kind
THROTTLE_S = 10.0  # one line per reason per this many seconds (proxy/refusals.py)


def _refusal_lines(log: Path) -> list[dict[str, object]]:
    """The sidecar's route_refused log lines."""
    lines = [orjson.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "route_refused"]


async def test_refusals_are_counted_and_their_log_lines_throttled(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("a-token-for-the-log-test")
    async with running_sim(fast("llamacpp", slot_save_path=str(tmp_path))) as engine:
        process, url = await start_sidecar(
            engine, tmp_path, "--engine", "llamacpp", "--admin-token-file", str(token_file)
        )
        try:
            started = time.monotonic()
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:

                async def status(method: str, target: str) -> int:
                    async with http.request(method, URL(url + target, encoded=True)) as resp:
                        return resp.status

                for _ in range(REFUSALS):
                    assert await status("GET", "/slots") == 401
                    assert await status("POST", "/%u0073lots/0?action=erase") == 400
            elapsed = time.monotonic() - started
            result = await scrape_fresh(url)
        finally:
            await stop(process)
    assert result.value("cachewitness_route_refusals_total", reason="missing_admin_token") == REFUSALS
    assert result.value("cachewitness_route_refusals_total", reason="invalid_request_target") == REFUSALS
    lines = _refusal_lines(tmp_path / "sidecar.log")
    bound = (
        1 + int(elapsed / THROTTLE_S) + 1
    )  # the first line, one per window passed, one for a window's edge
    for reason in ("missing_admin_token", "invalid_request_target"):
        mine = [line for line in lines if line["reason"] == reason]
        assert 1 <= len(mine) <= bound, (reason, len(mine), elapsed)
        assert mine[0]["refused"] == 1 and mine[0]["level"] == "warning"
        assert sum(int(str(line["refused"])) for line in mine) <= REFUSALS


async def test_a_refusal_line_says_what_was_refused_and_from_where(tmp_path: Path) -> None:
    async with running_sim(fast("vllm")) as engine:
        process, url = await start_sidecar(engine, tmp_path, "--engine", "vllm")
        try:
            connector = aiohttp.TCPConnector(local_addr=("127.0.0.6", 0))
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT, connector=connector) as http:
                async with http.post(url + "/collective_rpc") as resp:
                    assert resp.status == 403
        finally:
            await stop(process)
    (line,) = _refusal_lines(tmp_path / "sidecar.log")
    assert line["reason"] == "admin_loopback_only" and line["status"] == 403
    assert line["method"] == "POST" and line["path"] == "/collective_rpc" and line["peer"] == "127.0.0.6"
