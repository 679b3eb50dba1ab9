"""`cachewitness reset` / `evidence` as a user runs them: `python -m proxy ...` against a served sidecar."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import aiohttp
import pytest

from tests.support.cli import REPO, cli, sidecar
from tests.support.client import CLIENT_TIMEOUT
from tests.support.sidecar import closed_port_url, serve_sidecar
from tests.support.sim import chat, fast, sim, slow, words

TOKEN = "client-test-token"


async def test_acknowledged_exits_0_with_one_readable_line(tmp_path: Path) -> None:
    async with sidecar(fast("vllm"), tmp_path) as (_, url):
        run = await cli("reset", "--url", url, "--session-id", "s1", "--case-id", "c1")
    assert run.code == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("acknowledged: engine vllm 0.32.0, 1 attempt,")


async def test_json_prints_the_answer_body(tmp_path: Path) -> None:
    async with sidecar(fast("vllm"), tmp_path) as (_, url):
        run = await cli("reset", "--url", url, "--json", "--session-id", "s1")
    assert run.code == 0
    answer = json.loads(run.stdout)
    assert answer["answer"] == "acknowledged" and answer["cache_state"]["session_id"] == "s1"


async def test_bind_asks_to_bind_and_prints_the_case_token(tmp_path: Path) -> None:
    """`--bind`: the sidecar binds the verdict, and the one line shows the token to send."""
    async with (
        sidecar(fast("vllm"), tmp_path) as (_, url),
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        run = await cli("reset", "--url", url, "--bind", "--verify", "none")
        async with http.get(url + "/cache/state") as response:
            state = await response.json()
        plain = await cli("reset", "--url", url, "--verify", "none")
    assert run.code == 0, run.stderr
    token = run.stdout.split("case_token ", 1)[1].split()[0]
    assert len(token) >= 40 and state["bind"] is True
    # Without --bind nothing needs the token: the line does not show it.
    assert plain.code == 0 and "case_token" not in plain.stdout


async def test_isolation_request_isolates_the_case_until_its_next_reset(tmp_path: Path) -> None:
    """`--isolation request`: the case's requests are isolated; the line says so."""
    tags = {"X-Session-Id": "s1", "X-Case-Id": "c1"}
    async with (
        sidecar(fast("vllm"), tmp_path) as (_, url),
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        run = await cli(
            "reset", "--url", url, "--session-id", "s1", "--case-id", "c1", "--isolation", "request"
        )
        cached = []
        for _ in range(2):
            async with http.post(
                url + "/v1/chat/completions", json=chat(words(40), 2), headers=tags
            ) as response:
                cached.append((await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
        refused = await cli("reset", "--url", url, "--isolation", "request")
    assert run.code == 0, run.stderr
    assert "the case's requests are isolated until its next reset" in run.stdout
    assert cached == [0, 0]
    assert refused.code != 0 and "case_id" in refused.stdout + refused.stderr


async def test_accepted_unverified_exits_3(tmp_path: Path) -> None:
    async with sidecar(fast("vllm", legacy_empty_body=True), tmp_path) as (_, url):
        run = await cli("reset", "--url", url)
    assert run.code == 3 and run.stdout.startswith("accepted_unverified")


async def test_refused_exits_4(tmp_path: Path) -> None:
    async with (
        sidecar(slow("vllm"), tmp_path) as (engine, url),
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        request = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=chat(words(8), 5000)))
        await engine.wait_stats(lambda s: s["running"] == 1)
        run = await cli("reset", "--url", url, "--no-drain", "--retry-seconds", "0")
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
    assert run.code == 4 and run.stdout.startswith("refused")


async def test_unsupported_exits_5_and_prints_the_hint(tmp_path: Path) -> None:
    async with sidecar(fast("vllm", dev_mode=False), tmp_path) as (_, url):
        run = await cli("reset", "--url", url)
    assert run.code == 5
    assert "VLLM_SERVER_DEV_MODE=1" in run.stdout


async def test_unreachable_engine_exits_6(tmp_path: Path) -> None:
    async with serve_sidecar(closed_port_url(), tmp_path) as sidecar:
        run = await cli("reset", "--url", sidecar.url)
    assert run.code == 6 and run.stdout.startswith("unreachable")


@pytest.mark.parametrize("command", ["reset", "evidence"])
async def test_unreachable_sidecar_exits_8_and_says_so(command: str) -> None:
    run = await cli(command, "--url", closed_port_url())
    assert run.code == 8
    assert "cannot be reached" in run.stderr and len(run.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["reset", "evidence"])
async def test_url_of_something_that_is_not_a_sidecar_exits_8(tmp_path: Path, command: str) -> None:
    # The engine itself at --url: it answers, but not as a sidecar (its own 404).
    async with sim(fast("vllm")) as engine:
        run = await cli(command, "--url", engine.url)
    assert run.code == 8
    assert "not a cachewitness answer" in run.stderr and "--url" in run.stderr


@pytest.mark.parametrize("command", ["reset", "evidence"])
async def test_missing_token_exits_9_and_says_why(tmp_path: Path, command: str) -> None:
    async with sidecar(fast("vllm"), tmp_path, admin_token=TOKEN) as (_, url):
        run = await cli(command, "--url", url)
    assert run.code == 9
    assert "401" in run.stderr and "CACHEWITNESS_ADMIN_TOKEN" in run.stderr


@pytest.mark.parametrize("command", ["reset", "evidence"])
async def test_wrong_token_exits_9(tmp_path: Path, command: str) -> None:
    async with sidecar(fast("vllm"), tmp_path, admin_token=TOKEN) as (_, url):
        run = await cli(command, "--url", url, env={"CACHEWITNESS_ADMIN_TOKEN": "not-" + TOKEN})
    assert run.code == 9 and "wrong admin token" in run.stderr


@pytest.mark.parametrize("command", ["reset", "evidence"])
async def test_unreadable_token_file_exits_2(tmp_path: Path, command: str) -> None:
    async with sidecar(fast("vllm"), tmp_path) as (_, url):
        run = await cli(command, "--url", url, "--token-file", str(tmp_path / "missing"))
    assert run.code == 2 and "--token-file" in run.stderr


async def test_evidence_filter_the_sidecar_rejects_exits_2(tmp_path: Path) -> None:
    async with sidecar(fast("vllm"), tmp_path) as (_, url):
        run = await cli("evidence", "--url", url, "--event-type", "infer.nonsense")
    assert run.code == 2 and "event_type" in run.stderr


def test_cli_doc_exit_code_table_matches_the_client() -> None:
    from proxy.cli import http as client

    doc = (REPO / "docs" / "cli.md").read_text()
    section = doc.split("\n## Exit codes", 1)[1].split("\n#", 1)[0]
    documented = {
        int(cells[1].strip()): cells[2]
        for line in section.splitlines()
        if line.startswith("|") and (cells := line.split("|"))[1].strip().isdigit()
    }
    expected = set(client.EXIT_CODES.values()) | {
        client.EXIT_BAD_INPUT,
        client.EXIT_FAILED,
        client.EXIT_SIDECAR_UNREACHABLE,
        client.EXIT_ADMIN_REFUSED,
    }
    assert set(documented) == expected
    for answer, code in client.EXIT_CODES.items():
        assert f"`{answer}`" in documented[code], (answer, code)


async def test_token_file_is_sent(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    async with sidecar(fast("vllm"), tmp_path, admin_token=TOKEN) as (_, url):
        run = await cli("reset", "--url", url, "--token-file", str(token_file))
    assert run.code == 0, run.stderr


async def test_token_and_url_come_from_the_environment(tmp_path: Path) -> None:
    async with sidecar(fast("vllm"), tmp_path, admin_token=TOKEN) as (_, url):
        run = await cli("reset", env={"CACHEWITNESS_URL": url, "CACHEWITNESS_ADMIN_TOKEN": TOKEN})
    assert run.code == 0, run.stderr


async def test_input_the_sidecar_rejects_exits_2(tmp_path: Path) -> None:
    async with sidecar(fast("vllm"), tmp_path) as (_, url):
        run = await cli("reset", "--url", url, "--session-id", "bad id!")
    assert run.code == 2
    assert "session_id" in run.stderr


async def test_evidence_streams_the_records(tmp_path: Path) -> None:
    async with sidecar(fast("vllm"), tmp_path) as (_, url):
        assert (await cli("reset", "--url", url, "--session-id", "s1", "--case-id", "c1")).code == 0
        run = await cli("evidence", "--url", url, "--session-id", "s1", "--event-type", "infer.cache_state")
    assert run.code == 0, run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines()]
    assert [(r["event_type"], r["session_id"], r["case_id"]) for r in records] == [
        ("infer.cache_state", "s1", "c1")
    ]


async def test_evidence_summary_prints_a_row_per_case(tmp_path: Path) -> None:
    async with (
        sidecar(fast("vllm"), tmp_path) as (_, url),
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        assert (await cli("reset", "--url", url, "--session-id", "s1", "--case-id", "c1")).code == 0
        headers = {"X-Session-Id": "s1", "X-Case-Id": "c1"}
        for _ in range(2):
            async with http.post(
                f"{url}/v1/chat/completions", json=chat(words(40), 2), headers=headers
            ) as resp:
                assert resp.status == 200
        run = await cli("evidence", "--url", url, "--summary")
    assert run.code == 0, run.stderr
    header, *rows = run.stdout.strip().splitlines()
    assert header.split() == [
        "session",
        "case",
        "reset",
        "verified",
        "verdict",
        "requests",
        "prompt_tok",
        "cached_tok",
        "hit_ratio",
    ]
    row = [r.split() for r in rows if r.split()[:2] == ["s1", "c1"]]
    assert row and row[0][2:5] == ["acknowledged", "verified", "consistent"] and row[0][5] == "2"


@pytest.mark.parametrize("command", ["reset", "evidence"])
def test_help_lists_every_exit_code(capsys: pytest.CaptureFixture[str], command: str) -> None:
    from proxy.cli import http as client
    from proxy.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    codes = {*client.EXIT_CODES.values(), client.EXIT_SIDECAR_UNREACHABLE, client.EXIT_ADMIN_REFUSED}
    for code in sorted(codes | {client.EXIT_BAD_INPUT}):
        assert f" {code} " in text.split("exit codes:", 1)[1] + " ", code
    assert "8 sidecar unreachable" in text and "9 admin token refused" in text
