"""`cachewitness reset|evidence --scope cluster` as a user runs them, against a 3-pod cluster."""

from __future__ import annotations

import json
from pathlib import Path

from proxy.app import build_app
from tests.support.cli import cli
from tests.support.cluster import TOKEN, busy_engine, cluster
from tests.support.sidecar import make_settings, serve_app
from tests.support.sim import fast, slow


async def test_cluster_reset_prints_a_row_per_pod_and_exits_0(tmp_path: Path) -> None:
    """Every pod acknowledged: a table with each pod's answer and reset_id, exit 0."""
    async with cluster(tmp_path, [fast("vllm")] * 3) as c:
        run = await cli("reset", "--url", c.pods[0].url, "--scope", "cluster", "--session-id", "s1")
        assert run.code == 0, run.stderr
        rows = run.stdout.splitlines()
        assert rows[0].startswith("cluster acknowledged: reset_id ")
        for pod in c.pods:
            (row,) = [r for r in rows if r.startswith(pod.address)]
            assert row.split()[1:3] == ["200", "acknowledged"]


async def test_cluster_reset_exits_with_the_worst_pods_code(tmp_path: Path) -> None:
    """One pod refused (4), one not reached (8): exit 8, both named in the table."""
    async with cluster(tmp_path, [fast("vllm"), slow("vllm")]) as c:
        busy = c.pods[1]
        c.serve([c.pods[0].host, busy.host, "127.0.0.4"])
        async with busy_engine(busy):
            run = await cli(
                "reset", "--url", c.pods[0].url, "--scope", "cluster", "--retry-seconds", "0", "--no-drain"
            )
        assert run.code == 8, run.stdout + run.stderr
        answers = {line.split()[0]: line.split()[2] for line in run.stdout.splitlines()[2:]}
        assert answers == {
            c.pods[0].address: "acknowledged",
            busy.address: "refused",
            f"127.0.0.4:{c.port}": "unreachable",
        }


async def test_cluster_reset_refused_only_exits_4(tmp_path: Path) -> None:
    """The worst pod refused: exit 4 (refused), not the cluster's 409 read as something else."""
    async with cluster(tmp_path, [fast("vllm"), slow("vllm")]) as c:
        busy = c.pods[1]
        async with busy_engine(busy):
            run = await cli(
                "reset", "--url", c.pods[0].url, "--scope", "cluster", "--retry-seconds", "0", "--no-drain"
            )
        assert run.code == 4, run.stdout + run.stderr


async def test_cluster_reset_with_a_pod_refusing_the_token_exits_9(tmp_path: Path) -> None:
    """A pod with another admin token did not reset: exit 9, the admin-refused code."""
    async with cluster(tmp_path, [fast("vllm")], token=TOKEN) as c:
        settings = make_settings(
            c.pods[0].engine.url, tmp_path / "x", evidence=str(tmp_path / "x.jsonl"), admin_token="other"
        )
        async with serve_app(build_app(settings), "127.0.0.2", c.port):
            c.serve([c.pods[0].host, "127.0.0.2"])
            run = await cli(
                "reset", "--url", c.pods[0].url, "--scope", "cluster", env={"CACHEWITNESS_ADMIN_TOKEN": TOKEN}
            )
        assert run.code == 9, run.stdout + run.stderr
        assert "401" in run.stdout


async def test_cluster_evidence_prints_every_pods_records(tmp_path: Path) -> None:
    """`evidence --scope cluster --session-id S`: each pod's records, tagged with pod, then the trailer."""
    async with cluster(tmp_path, [fast("vllm")] * 3) as c:
        run = await cli("reset", "--url", c.pods[0].url, "--scope", "cluster", "--session-id", "sess-9")
        assert run.code == 0, run.stderr
        run = await cli("evidence", "--url", c.pods[1].url, "--scope", "cluster", "--session-id", "sess-9")
        assert run.code == 0, run.stderr
        *records, trailer = [json.loads(line) for line in run.stdout.splitlines()]
        assert trailer["event_type"] == "cachewitness.cluster_read"
        assert {r["pod"] for r in records} == {pod.address for pod in c.pods}


async def test_cluster_evidence_names_an_unreadable_pod_and_exits_6(tmp_path: Path) -> None:
    """A pod that cannot be read: the records of the others, its name on stderr, exit 6."""
    async with cluster(tmp_path, [fast("vllm")] * 2) as c:
        c.serve([c.pods[0].host, c.pods[1].host, "127.0.0.4"])
        run = await cli("evidence", "--url", c.pods[0].url, "--scope", "cluster", "--summary")
        assert run.code == 6, run.stdout + run.stderr
        assert f"127.0.0.4:{c.port}" in run.stderr
