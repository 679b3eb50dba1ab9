"""The interpreter a benched sidecar runs on, in an environment of its own when it needs one.

A deployment runs the image's CPython (python:3.11-slim: built with PGO and LTO). A
developer's pyenv build has neither, and at a paced load that costs the sidecar 4-19 % more
CPU per request (bench/README.md): a bench that means to stand for a deployment runs the
sidecar on an optimized build where the machine has one (Debian's python3.11 here).
"""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from pathlib import Path

__all__ = ["describe", "sidecar_python"]

ROOT = Path(__file__).resolve().parent.parent
_ENVS = ROOT / ".cache" / "bench-python"
# The sidecar's modules, imported from this checkout, with their dependencies: when they import,
# the interpreter is used as is. uvloop by name: the sidecar falls back to asyncio's loop without
# it, and a bench on that loop would measure something else.
_PROBE = "import proxy.serve, uvloop"


def sidecar_python(python: str | None) -> str:
    """The interpreter to run `python -m proxy serve` with: this one (None), `python` itself when
    its environment holds the project's dependencies, or a venv of `python`'s made (once) for it."""
    if python is None:
        return sys.executable
    if subprocess.run([python, "-c", _PROBE], cwd=ROOT, capture_output=True, check=False).returncode == 0:
        return python
    pyproject = (ROOT / "pyproject.toml").read_bytes()
    key = hashlib.sha256(str(Path(python).resolve()).encode() + pyproject).hexdigest()[:12]
    env = _ENVS / key
    interpreter = env / "bin" / "python"
    stamp = env / ".installed"
    if not stamp.exists():
        uv = Path(sys.executable).parent / "uv"
        print(f"bench: a venv of {python} for the sidecar, in {env} ...", flush=True)
        subprocess.run([str(uv), "venv", "-q", "--python", python, str(env)], check=True)
        subprocess.run(
            [str(uv), "pip", "install", "-q", "--python", str(interpreter), "-e", str(ROOT)], check=True
        )
        stamp.touch()
    return str(interpreter)


def describe(python: str) -> str:
    """`CPython 3.11.2 (/usr/bin/python3.11)`: the version and the interpreter the venv stands on."""
    out = subprocess.run(
        [python, "-c", "import platform, sys; print(platform.python_version(), sys._base_executable)"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    if len(out) < 2:
        return f"CPython {platform.python_version()} ({python})"
    return f"CPython {out[0]} ({out[1]})"
