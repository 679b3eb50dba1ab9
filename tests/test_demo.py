"""`cachewitness demo` runs end to end and reports what a benchmark session saw."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_the_session_and_prints_the_report() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "demo"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "second: 128 of 129 prompt tokens cached" in out
    assert "answer=acknowledged attempts=1, drain waited" in out
    assert "/cache/state verified: verified (the canary), verdict: consistent (the traffic)" in out
    assert "HTTP 502 answer=contradicted" in out and "--cache-ram 0" in out
    assert "/cache/state verified: contradicted, verdict: contradicted" in out
    summary = out[out.index("evidence summary") :]
    rows = {line.split()[1]: line.split()[2:6] for line in summary.splitlines() if line.startswith("demo ")}
    assert rows["cold-case"] == ["acknowledged", "verified", "consistent", "2"]
    # The undrained reset ran no request of its own: its case shows no verdict yet.
    assert rows["undrained"] == ["acknowledged", "unverified", "pending", "0"]
    # Every scene is in the summary: llama.cpp's and mindnano's sidecars too.
    assert rows["ram-cold"] == ["acknowledged", "contradicted", "contradicted", "1"]
    assert rows["mn-cold"][:3] == ["acknowledged", "unverified", "consistent"]
    mindnano = out[out.index("6. mindnano") :]
    assert "alice again: 669 of 669 prompt tokens cached" in mindnano
    assert "bob, same  : 0 of 669 prompt tokens cached" in mindnano
    assert "after the reset : 0 of 669 prompt tokens cached" in mindnano
    assert "/cache/state verdict: consistent" in mindnano
