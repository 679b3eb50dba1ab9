"""The distribution builds cleanly: no setuptools deprecation warning, SPDX license metadata."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_builds_without_deprecation_warnings(tmp_path: Path) -> None:
    # A copy of what the build reads, so the build leaves nothing in the checkout.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "proxy", source / "proxy", ignore=shutil.ignore_patterns("__pycache__"))
    # The test extra pins the setuptools this builds with, so no index is needed.
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    result = subprocess.run(
        [*command, "-v", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "deprecated" not in output.lower(), output[-3000:]
    (wheel,) = (tmp_path / "dist").glob("cachewitness-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        assert "License-Expression: Apache-2.0" in archive.read(metadata).decode().splitlines()
