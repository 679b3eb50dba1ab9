"""Cluster scope (issue 15): one reset URL for every pod, with a real DNS server doing the membership.

Each pod is a simulator and a sidecar; the sidecars listen on 127.0.0.1, .2, .3 … on one
port, and a dnslib server answers the headless-Service name with their addresses.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.cluster.peers import discover_peers
from proxy.config import SETTINGS, ConfigError, Settings
from proxy.config.load import load_settings
from proxy.evidence.log import EVIDENCE
from proxy.witnesses.canary import MOST_CANARY_CALLS
from tests.support.client import CLIENT_TIMEOUT
from tests.support.cluster import RESETS_PER_VERIFIED, SERVICE, TOKEN, Pod, busy_engine, cluster, shared_port
from tests.support.dns_server import dns_server
from tests.support.kv_events import Ports
from tests.support.sidecar import serve_app, serve_sidecar, stack
from tests.support.sim import chat, fast, sim, slow, words


async def warm(pod: Pod, prompt: str) -> int:
    """Send `prompt` twice straight to the pod's engine; the second one's cached tokens."""
    await pod.engine.cached(chat(prompt))
    return await pod.engine.cached(chat(prompt))


PROMPT = words(64, "shared")


async def test_cluster_reset_resets_every_engine(tmp_path: Path) -> None:
    """One call on one pod: all three engines reset (their own counters and caches say so), one 200."""
    async with cluster(tmp_path, [fast("vllm")] * 3) as c:
        for pod in c.pods:
            assert await warm(pod, PROMPT) > 0
        status, body = await c.reset({"scope": "cluster", "session_id": "s1", "case_id": "c1"}, query="")
        assert status == 200, body
        assert (body["answer"], body["success"], body["scope"]) == ("acknowledged", True, "cluster")
        assert sorted(p["pod"] for p in body["pods"]) == sorted(pod.address for pod in c.pods)
        assert {p["answer"] for p in body["pods"]} == {"acknowledged"}
        for pod in c.pods:
            assert (await pod.engine.stats())["resets_total"] == RESETS_PER_VERIFIED
            assert await pod.engine.cached(chat(PROMPT)) == 0


async def test_each_pod_records_the_cluster_reset_as_its_parent(tmp_path: Path) -> None:
    """Every pod's own infer.cache_state carries parent_reset_id; the receiving pod adds a scope=cluster record."""
    async with cluster(tmp_path, [fast("vllm")] * 3) as c:
        status, body = await c.reset({"session_id": "s1", "case_id": "c1"}, query="?scope=cluster")
        assert status == 200, body
        cluster_id = body["reset_id"]
        pod_ids = {p["pod"]: p["reset_id"] for p in body["pods"]}
        for pod in c.pods:
            await pod.app[EVIDENCE].flush()
            own = [r for r in pod.records() if r.get("parent_reset_id") == cluster_id]
            assert len(own) == 1, pod.records()
            assert own[0]["reset_id"] == pod_ids[pod.address]
            assert (own[0]["session_id"], own[0]["case_id"]) == ("s1", "c1")
        (summary,) = [r for r in c.pods[0].records() if r.get("scope") == "cluster"]
        assert summary["event_type"] == "infer.cache_state"
        assert summary["reset_id"] == cluster_id
        assert summary["via"] == "cluster" and all(r["via"] == "api" for r in own)
        assert summary["acknowledged"] is True
        assert summary["reset"]["answer"] == "acknowledged"
        assert [p["pod"] for p in summary["pods"]] == [p["pod"] for p in body["pods"]]
        assert not [r for pod in c.pods[1:] for r in pod.records() if r.get("scope") == "cluster"]


async def test_one_pod_down_is_a_partial_502_naming_it(tmp_path: Path) -> None:
    """DNS lists a fourth address nobody serves: 502 partial, that pod unreachable, the others reset."""
    async with cluster(tmp_path, [fast("vllm")] * 3) as c:
        c.serve([pod.host for pod in c.pods] + ["127.0.0.4"])
        status, body = await c.reset()
        assert status == 502, body
        assert (body["answer"], body["success"]) == ("partial", False)
        by_pod = {p["pod"]: p for p in body["pods"]}
        down = by_pod[f"127.0.0.4:{c.port}"]
        assert down["answer"] == "unreachable" and down["status"] is None and down["error"]
        assert f"127.0.0.4:{c.port}" in body["detail"]
        assert all(by_pod[pod.address]["answer"] == "acknowledged" for pod in c.pods)
        for pod in c.pods:
            assert (await pod.engine.stats())["resets_total"] == RESETS_PER_VERIFIED


async def test_one_engine_refusing_is_a_409_naming_its_pod(tmp_path: Path) -> None:
    """vLLM refuses while a request runs: with no retry window that pod is refused, the answer 409."""
    async with cluster(tmp_path, [fast("vllm"), slow("vllm"), fast("vllm")]) as c:
        busy = c.pods[1]
        async with busy_engine(busy):
            status, body = await c.reset({"scope": "cluster", "retry_seconds": 0, "drain": False}, query="")
        assert status == 409, body
        assert (body["answer"], body["success"]) == ("refused", False)
        by_pod = {p["pod"]: p["answer"] for p in body["pods"]}
        assert by_pod == {
            c.pods[0].address: "acknowledged",
            busy.address: "refused",
            c.pods[2].address: "acknowledged",
        }


async def test_dns_answer_change_is_seen_by_the_next_call(tmp_path: Path) -> None:
    """Membership is resolved on every call: a pod added to the Service is in the next reset, a removed one is not."""
    async with cluster(tmp_path, [fast("vllm")] * 3) as c:
        c.serve([c.pods[0].host, c.pods[1].host])
        status, first = await c.reset()
        assert status == 200, first
        assert sorted(p["pod"] for p in first["pods"]) == sorted(pod.address for pod in c.pods[:2])
        c.serve([c.pods[1].host, c.pods[2].host])
        status, second = await c.reset()
        assert status == 200, second
        assert sorted(p["pod"] for p in second["pods"]) == sorted(pod.address for pod in c.pods[1:])
        assert [(await pod.engine.stats())["resets_total"] for pod in c.pods] == [
            RESETS_PER_VERIFIED * n for n in (1, 2, 1)
        ]


async def test_empty_peer_set_is_a_502_with_a_hint(tmp_path: Path) -> None:
    """A Service with no ready pod (no A records) or no such name: 502, never a silent success."""
    async with cluster(tmp_path, [fast("vllm")]) as c:
        c.serve([])
        status, body = await c.reset()
        assert status == 502, body
        assert (body["answer"], body["success"], body["pods"]) == ("error", False, [])
        assert SERVICE in body["detail"] and body["hint"]
        c.dns.records.clear()
        status, body = await c.reset()
        assert status == 502, body
        assert "DNS lookup" in body["detail"] and body["hint"]
        assert (await c.pods[0].engine.stats())["resets_total"] == 0


async def test_no_peers_configured_is_a_502_with_a_hint(tmp_path: Path) -> None:
    """A sidecar with neither peers nor peers_dns says how to set them."""
    async with stack(fast("vllm"), tmp_path) as s:
        status, body = await s.reset(query="?scope=cluster")
        assert status == 502, body
        assert "peers_dns" in body["hint"]
        assert (await s.engine.stats())["resets_total"] == 0


async def test_static_peers_list_reaches_every_pod(tmp_path: Path) -> None:
    """`peers = host:port,...` without DNS: every listed sidecar resets."""
    async with AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(sim(fast("sglang"))) for _ in range(2)]
        ports = [shared_port(["127.0.0.1"]) for _ in engines]
        peers = tuple(f"127.0.0.1:{port}" for port in ports)
        urls = []
        for index, (engine, port) in enumerate(zip(engines, ports, strict=True)):
            pod = serve_sidecar(
                engine.url,
                tmp_path / f"pod{index}",
                port=port,
                evidence=str(tmp_path / f"e{index}.jsonl"),
                peers=peers,
            )
            urls.append((await stack.enter_async_context(pod)).url)
        async with (
            aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
            http.post(f"{urls[1]}/cache/reset?scope=cluster") as resp,
        ):
            body = await resp.json()
        assert resp.status == 200, body
        assert [p["pod"] for p in body["pods"]] == list(peers)
        assert [(await engine.stats())["resets_total"] for engine in engines] == [RESETS_PER_VERIFIED] * 2


async def test_admin_token_is_forwarded_to_every_pod(tmp_path: Path) -> None:
    """Pods with an admin token: the fan-out carries it, so every pod resets."""
    async with cluster(tmp_path, [fast("vllm")] * 3, token=TOKEN) as c:
        status, body = await c.reset()
        assert status == 200, body
        assert {p["answer"] for p in body["pods"]} == {"acknowledged"}


async def test_a_pod_with_another_token_is_named_in_a_partial(tmp_path: Path) -> None:
    """A pod that refuses the token did not reset: 502 partial naming it with its 401."""
    async with cluster(tmp_path, [fast("vllm")] * 2, token=TOKEN) as c:
        stranger_engine = c.pods[1].engine
        async with serve_sidecar(
            stranger_engine.url,
            tmp_path / "x",
            host="127.0.0.3",
            port=c.port,
            evidence=str(tmp_path / "x.jsonl"),
            admin_token="other",
        ):
            c.serve([c.pods[0].host, "127.0.0.3"])
            status, body = await c.reset()
        assert status == 502, body
        stranger = next(p for p in body["pods"] if p["pod"] == f"127.0.0.3:{c.port}")
        assert (stranger["answer"], stranger["status"]) == ("error", 401)


async def test_bad_scope_is_a_400_naming_it(tmp_path: Path) -> None:
    """scope is pod or cluster; a cluster reset cannot name a parent."""
    async with cluster(tmp_path, [fast("vllm")]) as c:
        status, body = await c.reset(query="?scope=everything")
        assert (status, body["error"]["param"]) == (400, "scope")
        status, body = await c.reset({"scope": "cluster", "parent_reset_id": "abc"}, query="")
        assert (status, body["error"]["param"]) == (400, "parent_reset_id")
        status, raw = await c.get("/cache/evidence?scope=all")
        assert status == 400 and orjson.loads(raw)["error"]["param"] == "scope"


async def chat_on(pod: Pod, http: aiohttp.ClientSession, session_id: str, text: str) -> None:
    """One chat request through the pod's sidecar, tagged with a session."""
    async with http.post(
        f"{pod.url}/v1/chat/completions", json=chat(text), headers={"X-Session-Id": session_id}
    ) as resp:
        assert resp.status == 200
        await resp.read()


def evidence_lines(raw: bytes) -> list[dict[str, Any]]:
    """Decode JSON lines."""
    return [orjson.loads(line) for line in raw.splitlines() if line.strip()]


async def test_merged_evidence_holds_every_pods_records_in_time_order(tmp_path: Path) -> None:
    """GET /cache/evidence?scope=cluster&session_id=S: each pod's reset and requests, tagged, by at_ns."""
    async with cluster(tmp_path, [fast("vllm")] * 3) as c:
        status, body = await c.reset({"scope": "cluster", "session_id": "sess-1"}, query="")
        assert status == 200, body
        for index, pod in enumerate(c.pods):
            await chat_on(pod, c.http, "sess-1", f"hello {index}")
        await chat_on(c.pods[0], c.http, "other-session", "not this one")
        status, raw = await c.get("/cache/evidence?scope=cluster&session_id=sess-1", via=2)
        assert status == 200
        *records, trailer = evidence_lines(raw)
        assert trailer["event_type"] == "cachewitness.cluster_read"
        assert sorted(trailer["pods_read"]) == sorted(pod.address for pod in c.pods)
        assert trailer["unreadable"] == []
        for pod in c.pods:
            mine = [r for r in records if r["pod"] == pod.address]
            types = sorted(r["event_type"] for r in mine)
            assert types.count("infer.cache_observation") == 1, mine
            assert any(r.get("parent_reset_id") == body["reset_id"] for r in mine)
        assert all(r["session_id"] == "sess-1" for r in records)
        assert [r["at_ns"] for r in records] == sorted(r["at_ns"] for r in records)
        # The receiving pod's cluster record is in its own evidence too.
        assert any(r.get("scope") == "cluster" and r["pod"] == c.pods[0].address for r in records)


async def test_merged_evidence_names_a_pod_that_cannot_be_read(tmp_path: Path) -> None:
    """A pod down is named in the trailing line; the others' records still come."""
    async with cluster(tmp_path, [fast("vllm")] * 2) as c:
        await chat_on(c.pods[1], c.http, "sess-2", "hi")
        c.serve([c.pods[0].host, c.pods[1].host, "127.0.0.4"])
        status, raw = await c.get("/cache/evidence?scope=cluster&session_id=sess-2")
        assert status == 200
        *records, trailer = evidence_lines(raw)
        assert [r["pod"] for r in records] == [c.pods[1].address]
        (missing,) = trailer["unreadable"]
        assert missing["pod"] == f"127.0.0.4:{c.port}" and missing["error"]


async def test_merged_state_lists_every_pod_and_names_the_unreadable(tmp_path: Path) -> None:
    """GET /cache/state?scope=cluster: each pod's state under its name; a pod down in `unreadable`."""
    async with cluster(tmp_path, [fast("vllm")] * 2) as c:
        status, body = await c.reset()
        assert status == 200, body
        c.serve([c.pods[0].host, c.pods[1].host, "127.0.0.4"])
        status, raw = await c.get("/cache/state?scope=cluster")
        assert status == 200
        state = orjson.loads(raw)
        assert state["scope"] == "cluster"
        by_pod = {p["pod"]: p["state"] for p in state["pods"]}
        pod_ids = {p["pod"]: p["reset_id"] for p in body["pods"]}
        assert {pod: s["reset_id"] for pod, s in by_pod.items()} == pod_ids
        assert [u["pod"] for u in state["unreadable"]] == [f"127.0.0.4:{c.port}"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"peers": "10.0.0.5"}, "peers"),
        ({"peers": "10.0.0.5:0"}, "peers"),
        ({"peers_dns": "bad_name.svc"}, "peers_dns"),
        ({"peers_dns": "svc.ns:70000"}, "peers_dns"),
        ({"peers_dns_server": "dns.example"}, "peers_dns_server"),
        ({"peers": "10.0.0.5:9000", "peers_dns": "svc"}, "not both"),
    ],
)
def test_bad_peer_settings_fail_with_the_key_named(flags: dict[str, str], named: str) -> None:
    """A malformed peer setting, or both kinds at once, is one ConfigError naming it."""
    with pytest.raises(ConfigError, match=named):
        load_settings(flags, env={})


def test_peer_settings_parse_from_env() -> None:
    """The Helm chart's env var and a static list both load."""
    settings = load_settings(
        {},
        env={
            "CACHEWITNESS_PEERS_DNS": "cw-peers.ns.svc.cluster.local",
            "CACHEWITNESS_PEERS_DNS_SERVER": "[::1]:53",
        },
    )
    assert (settings.peers_dns, settings.peers_dns_server) == ("cw-peers.ns.svc.cluster.local", "[::1]:53")
    assert load_settings({"peers": "10.0.0.5:9000, [::1]:9001"}, env={}).peers == (
        "10.0.0.5:9000",
        "[::1]:9001",
    )


async def test_merged_evidence_of_many_records_keeps_every_line_in_time_order(tmp_path: Path) -> None:
    """Many lines per pod (several network reads each): all of them, merged in at_ns order."""
    async with cluster(tmp_path, [fast("vllm")] * 3) as c:
        for round_ in range(40):
            for index, pod in enumerate(c.pods):
                await chat_on(pod, c.http, "sess-many", f"round {round_} pod {index} " + words(40))
        status, raw = await c.get("/cache/evidence?scope=cluster&session_id=sess-many")
        assert status == 200
        *records, trailer = evidence_lines(raw)
        assert trailer["records"] == len(records) == 120
        assert [r["at_ns"] for r in records] == sorted(r["at_ns"] for r in records)
        for pod in c.pods:
            status, own = await c.get("/cache/evidence?session_id=sess-many", via=c.pods.index(pod))
            mine = [r for r in records if r["pod"] == pod.address]
            assert [r["request_id"] for r in mine] == [r["request_id"] for r in evidence_lines(own)]


async def test_merged_evidence_names_a_pod_that_breaks_off_mid_answer(tmp_path: Path) -> None:
    """A peer that sends two lines then drops the connection mid-answer is named in the trailer."""

    async def breaks_off(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        await response.write(b'{"event_type": "infer.cache_observation", "at_ns": 1}\n{"at_ns": 2}\n{"at_n')
        assert request.transport is not None
        request.transport.close()  # FIN, not RST: the two lines sent arrive, the chunked body never ends
        return response

    dying = web.Application()
    dying.router.add_get("/cache/evidence", breaks_off)
    async with cluster(tmp_path, [fast("vllm")]) as c:
        async with serve_app(dying, "127.0.0.2", c.port):
            c.serve([c.pods[0].host, "127.0.0.2"])
            status, raw = await c.get("/cache/evidence?scope=cluster")
        assert status == 200
        *records, trailer = evidence_lines(raw)
        # Lines that arrived before the break may or may not be handed over (aiohttp raises a
        # payload error before buffered data), so only the healthy pod's count is pinned.
        assert trailer["pods_read"] == [c.pods[0].address]
        (broken,) = trailer["unreadable"]
        assert broken["pod"] == f"127.0.0.2:{c.port}" and "the read broke off after" in broken["error"]
        assert all(r["pod"] in (c.pods[0].address, broken["pod"]) for r in records)


async def test_cluster_deadline_covers_each_pods_canary(tmp_path: Path) -> None:
    """The shared deadline waits out a pod's canary when one is asked for, and not when verify is none."""
    async with cluster(tmp_path, [fast("vllm")]) as c:
        status, with_canary = await c.reset({"scope": "cluster", "verify": "canary"}, query="")
        assert status == 200, with_canary
        status, without = await c.reset({"scope": "cluster", "verify": "none"}, query="")
        assert status == 200, without
        settings = c.pods[0].app[SETTINGS]
        canary_s = MOST_CANARY_CALLS * settings.reset_attempt_timeout + 2 * (
            2 * settings.retry_seconds + settings.reset_attempt_timeout
        )
        assert with_canary["deadline_s"] - without["deadline_s"] == pytest.approx(canary_s)


async def test_every_pod_verified_by_its_canary_is_a_verified_success(tmp_path: Path) -> None:
    """vLLM pods whose canaries all verify: 200, success true, each pod and the record say verified."""
    async with cluster(tmp_path, [fast("vllm")] * 2) as c:
        status, body = await c.reset()
        assert status == 200, body
        assert (body["answer"], body["success"]) == ("acknowledged", True)
        assert {p["verified"] for p in body["pods"]} == {"verified"}
        assert body["cache_state"]["verified"] == "verified"


async def test_a_pod_contradicted_by_its_canary_is_a_502_contradicted(tmp_path: Path) -> None:
    """llama.cpp keeping its RAM prompt cache: that pod contradicted, the cluster 502 contradicted."""
    async with cluster(
        tmp_path, [fast("vllm"), fast("llamacpp", slot_save_path=str(tmp_path), ram_cache=True)]
    ) as c:
        status, body = await c.reset()
        assert status == 502, body
        assert (body["answer"], body["success"]) == ("contradicted", False)
        by_pod = {p["pod"]: p for p in body["pods"]}
        assert by_pod[c.pods[1].address]["verified"] == "contradicted"
        assert by_pod[c.pods[0].address]["verified"] == "verified"
        assert body["cache_state"]["verified"] == "contradicted"
        assert c.pods[1].address in body["detail"]


async def test_an_acknowledged_pod_its_canary_could_not_verify_is_not_a_success(tmp_path: Path) -> None:
    """A pod whose engine reports no cached tokens: acknowledged, canary unverified, so 200 without success."""
    async with cluster(tmp_path, [fast("vllm"), fast("vllm", prompt_tokens_details=False)]) as c:
        status, body = await c.reset()
        assert status == 200, body
        assert body["answer"] == "accepted_unverified"
        assert "success" not in body
        blind = next(p for p in body["pods"] if p["pod"] == c.pods[1].address)
        assert (blind["answer"], blind["verified"]) == ("acknowledged", "unverified")
        assert "cached-token" in blind["error"]


@pytest.mark.parametrize("verify", ["events", "both"])
async def test_a_pod_its_events_witness_could_not_verify_is_not_a_success(
    tmp_path: Path, verify: str
) -> None:
    """The pod binds a KV-events socket no engine publishes to: acknowledged, but its events witness saw
    no clear, so the pod is unverified and the cluster 200 is `accepted_unverified`, never a success."""
    async with cluster(tmp_path, [fast("vllm")], kv_events_endpoint=Ports().endpoint) as c:
        status, body = await c.reset({"scope": "cluster", "verify": verify}, query="")
        assert status == 200, body
        (pod,) = body["pods"]
        assert (pod["answer"], pod["verified"]) == ("acknowledged", "unverified"), pod
        assert (body["answer"], "success" in body) == ("accepted_unverified", False), body
        assert "AllBlocksCleared" in pod["error"]


@pytest.mark.slow
async def test_a_pod_that_never_answers_is_unreachable_at_the_shared_deadline(tmp_path: Path) -> None:
    """A peer that takes the call and hangs: the others' answers come at the deadline, that pod unreachable."""
    never = asyncio.Event()

    async def hangs(request: web.Request) -> web.Response:
        await never.wait()
        return web.json_response({})

    hung = web.Application()
    hung.router.add_post("/cache/reset", hangs)
    async with cluster(tmp_path, [fast("vllm")], reset_attempt_timeout=0.5) as c:
        async with serve_app(hung, "127.0.0.2", c.port):
            c.serve([c.pods[0].host, "127.0.0.2"])
            status, body = await c.reset(
                {"scope": "cluster", "drain": False, "retry_seconds": 0, "verify": "none"}, query=""
            )
        assert status == 502, body
        assert body["deadline_s"] == pytest.approx(0.5 + 10.0)
        by_pod = {p["pod"]: p for p in body["pods"]}
        assert by_pod[c.pods[0].address]["answer"] == "acknowledged"
        assert "no answer within the cluster deadline" in by_pod[f"127.0.0.2:{c.port}"]["error"]


async def test_a_dual_stack_name_lists_each_pod_once(tmp_path: Path) -> None:
    """A and AAAA records for the same pods: the IPv4 ones only; AAAA alone when there is no A record."""
    async with dns_server() as dns:
        dns.set("dual.test", ["10.0.0.1", "fd00::1", "10.0.0.2", "fd00::2"])
        dns.set("v6.test", ["fd00::1", "fd00::2"])
        dual = await discover_peers(Settings(peers_dns="dual.test:9000", peers_dns_server=dns.address))
        assert sorted(peer.address for peer in dual.peers) == ["10.0.0.1:9000", "10.0.0.2:9000"]
        v6 = await discover_peers(Settings(peers_dns="v6.test:9000", peers_dns_server=dns.address))
        assert sorted(peer.address for peer in v6.peers) == ["[fd00::1]:9000", "[fd00::2]:9000"]
