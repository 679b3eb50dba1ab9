"""The README's examples run as printed: its command lines, then its benchmark-client snippet.

Only what cannot be the same here changes: ports (free loopback ones instead of 8000/8200),
the token file and evidence paths (under tmp_path), and the snippet's two placeholders.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import aiohttp

from tests.support.client import CLIENT_TIMEOUT
from tests.support.sidecar import free_port
from tests.support.sim import POLL_S, WAIT_S

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
LONG_RUNNING = ("sim", "serve")  # started first, in this order; the others run to their exit


def fenced_blocks(section: str, language: str) -> list[str]:
    """The ```language blocks of the README section headed `section`."""
    text = README.split(section, 1)[1].split("\n## ", 1)[0]
    return [part.split("```", 1)[0] for part in text.split(f"```{language}\n")[1:]]


def command_lines(block: str) -> list[list[str]]:
    """The block's commands: continuation lines joined, comments dropped, split as a shell would."""
    return [
        shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines() if line.strip()
    ]


async def run(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run one command to its end (bounded)."""
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@asynccontextmanager
async def background(argv: list[str], env: dict[str, str]) -> AsyncIterator[None]:
    """A long-running command, stopped with SIGTERM (as Kubernetes would) at the end."""
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=REPO, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        yield
    finally:
        if process.returncode is None:
            process.terminate()
        await asyncio.wait_for(process.wait(), timeout=60)


async def wait_ready(url: str) -> None:
    """Poll the sidecar's readiness (the engine behind it answered) until it says so."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S * 3  # two fresh interpreters start first
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
        while True:
            try:
                async with http.get(url + "/-/ready") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert loop.time() < deadline, f"{url} never became ready"
            await asyncio.sleep(POLL_S * 20)


def local(text: str, sidecar_port: int, sim_port: int, tmp_path: Path) -> str:
    """The README's text with this machine's ports and paths."""
    return (
        text.replace("0.0.0.0:8000", f"127.0.0.1:{sidecar_port}")
        .replace("127.0.0.1:8000", f"127.0.0.1:{sidecar_port}")
        .replace("127.0.0.1:8200", f"127.0.0.1:{sim_port}")
        .replace("/run/secrets/cw-token", str(tmp_path / "cw-token"))
        .replace("./evidence/cachewitness.jsonl", str(tmp_path / "evidence" / "cachewitness.jsonl"))
    )


async def test_readme_commands_and_client_snippet_run_as_printed(tmp_path: Path) -> None:
    sidecar_port, sim_port = free_port(), free_port()
    (tmp_path / "cw-token").write_text("readme-token\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEWITNESS_")}
    block = fenced_blocks("## Run it", "sh")[0]
    commands = command_lines(local(block, sidecar_port, sim_port, tmp_path))
    assert [c[:2] for c in commands] == [
        ["pip", "install"],
        ["cachewitness", "serve"],
        ["cachewitness", "reset"],
        ["cachewitness", "evidence"],
        ["cachewitness", "sim"],
    ]
    # `python -m proxy …` is the same as `cachewitness …` (and needs no install of the script).
    as_module = {c[1]: [sys.executable, "-m", "proxy", *c[1:]] for c in commands if c[0] == "cachewitness"}
    sidecar = f"http://127.0.0.1:{sidecar_port}"
    async with AsyncExitStack() as stack:
        for name in LONG_RUNNING:
            await stack.enter_async_context(background(as_module[name], env))
        await wait_ready(sidecar)
        code, out, err = await run(as_module["reset"], env)
        assert code == 0, (out, err)
        assert out.startswith("acknowledged")
        code, out, err = await run(as_module["evidence"], env)
        assert code == 0, (out, err)
        assert "run1" in out and "c1" in out and "acknowledged" in out

        # The client snippet, after the `pip install openai` it says it needs.
        [install, *_] = fenced_blocks("### From a benchmark client", "sh")
        assert command_lines(install) == [["pip", "install", "openai"]]
        [snippet] = fenced_blocks("### From a benchmark client", "python")
        assert snippet.count('"http://llm:8000"') == 1 and snippet.count('"<admin token>"') == 1
        script = tmp_path / "client.py"
        script.write_text(
            snippet.replace("http://llm:8000", sidecar).replace("<admin token>", "readme-token")
        )
        code, out, err = await run([sys.executable, str(script)], env)
        assert code == 0, (out, err)
        assert out.strip() == "consistent"
