"""`cachewitness reset` / `evidence` as a user runs them: `python -m proxy ...` in a child process."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.sim import SimConfig
from tests.support.sidecar import stack
from tests.support.sim import Sim

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Run:
    """A finished client command."""

    code: int
    stdout: str
    stderr: str


async def cli(*args: str, env: dict[str, str] | None = None) -> Run:
    """Run `python -m proxy ARGS` without blocking the event loop that serves the sidecar."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CACHEWITNESS_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy",
        *args,
        cwd=REPO,
        env={**clean, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return Run(process.returncode, out.decode(), err.decode())


@asynccontextmanager
async def sidecar(config: SimConfig, tmp_path: Path, **overrides: Any) -> AsyncIterator[tuple[Sim, str]]:
    """A simulator and a sidecar in front of it; yields both."""
    async with stack(config, tmp_path, **overrides) as s:
        yield s.engine, s.url
