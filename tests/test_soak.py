"""The 60-second `make soak` (bench/soak.py) runs in CI: each of its criteria must hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.soak
@pytest.mark.timeout(400)
def test_a_60_second_soak_keeps_memory_flat_and_every_record_accounted() -> None:
    """Mixed load, the engine killed and restarted, the evidence disk filled and freed (bench/soak.py)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--seconds", "60"],
        capture_output=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    table = result.stdout.decode()
    assert result.returncode == 0, table + result.stderr.decode()[-4000:]
    assert "- [ ]" not in table and table.count("- [x]") == 6
