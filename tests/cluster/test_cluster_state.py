"""`GET /cache/state?scope=cluster`: the verdict counts sum every pod's (proxy/cluster/state.py)."""

from __future__ import annotations

from pathlib import Path

import orjson

from tests.support.cluster import cluster
from tests.support.sim import chat, fast, words


async def test_cluster_verdict_counts_sum_over_the_pods(tmp_path: Path) -> None:
    """Three pods reset together; one pod's traffic settles its verdict, the other two stay pending."""
    async with cluster(tmp_path, [fast("vllm")] * 3) as c:
        status, body = await c.reset({"drain": False, "verify": "none"})
        assert status == 200, body
        async with c.http.post(
            f"{c.pods[0].url}/v1/chat/completions", json=chat(words(16, "cold"))
        ) as response:
            assert response.status == 200
            await response.read()
        status, raw = await c.get("/cache/state?scope=cluster", via=1)
        assert status == 200
        state = orjson.loads(raw)
    by_pod = {pod["pod"]: pod["state"]["verdict"] for pod in state["pods"]}
    assert by_pod[c.pods[0].address] != "pending"
    assert [by_pod[pod.address] for pod in c.pods[1:]] == ["pending", "pending"]
    assert state["verdicts"] == {by_pod[c.pods[0].address]: 1, "pending": 2}
