"""A small tmpfs for full-disk tests: mounted at a path, resized to fill or free it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["mount", *args], capture_output=True, timeout=30, check=False)


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax: 64k, 16m) at `path`; the test is skipped where this
    machine cannot mount one (not root, or no CAP_SYS_ADMIN in a container)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30, check=False)


def resize(path: Path, size: str) -> None:
    """Grow or shrink a mounted tmpfs (space returns, or the disk fills)."""
    result = _mount("-o", f"remount,size={size}", str(path))
    assert result.returncode == 0, result.stderr.decode()
