"""Cluster calls over TLS (issue 27): `peers_scheme = https`, each pod's certificate checked against `peers_ca_file`.

A cluster reset carries the admin token to every peer; over plain http anyone on the path
reads it. Here each pod is a simulator and a sidecar (serve.py's runner) with TLS ended in
front of it by tests/support/tls_helpers.py, the certificates signed by a CA made for the test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.config import ConfigError
from proxy.config.load import load_settings
from tests.support.client import CLIENT_TIMEOUT
from tests.support.cluster import RESETS_PER_VERIFIED, SERVICE, shared_port
from tests.support.dns_server import dns_server
from tests.support.sidecar import free_port, serve_sidecar
from tests.support.sim import Sim, fast, sim
from tests.support.tls_helpers import Certificates, TlsFront, make_certificates, tls_front

TOKEN = "tls-cluster-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class TlsPod:
    """One pod: its engine, its sidecar's plain URL, and the TLS front the other pods call."""

    engine: Sim
    url: str
    front: TlsFront


@asynccontextmanager
async def tls_cluster(
    tmp_path: Path, certs: Certificates, hosts: list[str], front_ports: list[int], **settings: Any
) -> AsyncIterator[list[TlsPod]]:
    """A pod on each host: sidecar on a port of its own, TLS front on `front_ports[i]`."""
    async with AsyncExitStack() as stack:
        pods = []
        for index, (host, port) in enumerate(zip(hosts, front_ports, strict=True)):
            engine = await stack.enter_async_context(sim(fast("vllm")))
            sidecar = await stack.enter_async_context(
                serve_sidecar(
                    engine.url,
                    tmp_path / f"pod{index}",
                    host=host,
                    evidence=str(tmp_path / f"pod{index}" / "cachewitness.jsonl"),
                    admin_token=TOKEN,
                    **settings,
                )
            )
            backend = sidecar.url.removeprefix("http://")
            front = await stack.enter_async_context(tls_front(certs, host, port, backend))
            pods.append(TlsPod(engine, sidecar.url, front))
        yield pods


async def cluster_reset(http: aiohttp.ClientSession, pod: TlsPod) -> tuple[int, dict[str, Any]]:
    """POST /cache/reset?scope=cluster on one pod's plain port."""
    async with http.post(f"{pod.url}/cache/reset?scope=cluster", headers=HEADERS) as response:
        return response.status, await response.json()


async def test_a_cluster_reset_over_https_verified_by_peers_ca_file_reaches_every_pod(tmp_path: Path) -> None:
    """Static peers over https: every pod resets, the cluster reads go over TLS too."""
    certs = make_certificates(tmp_path / "tls", names=[], addresses=["127.0.0.1"])
    ports = [free_port(), free_port()]
    peers = tuple(f"127.0.0.1:{port}" for port in ports)
    async with (
        tls_cluster(
            tmp_path,
            certs,
            ["127.0.0.1"] * 2,
            ports,
            peers=peers,
            peers_scheme="https",
            peers_ca_file=str(certs.ca),
        ) as pods,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        status, body = await cluster_reset(http, pods[0])
        assert status == 200, body
        assert [(p["pod"], p["answer"]) for p in body["pods"]] == [(peer, "acknowledged") for peer in peers]
        assert all(p["url"].startswith("https://") for p in body["pods"])
        for pod in pods:
            assert (await pod.engine.stats())["resets_total"] == RESETS_PER_VERIFIED
            assert pod.front.handshakes >= 1
        async with http.get(f"{pods[1].url}/cache/state?scope=cluster", headers=HEADERS) as response:
            state = await response.json()
        assert (state["unreadable"], len(state["pods"])) == ([], 2)
        async with http.get(f"{pods[1].url}/cache/evidence?scope=cluster", headers=HEADERS) as response:
            lines = [orjson.loads(line) for line in (await response.read()).splitlines()]
        assert lines[-1]["unreadable"] == [] and sorted(lines[-1]["pods_read"]) == sorted(peers)


async def test_without_the_ca_the_pods_certificates_fail_verification_and_no_token_is_sent(
    tmp_path: Path,
) -> None:
    """https against the system's CAs: no pod verifies, the answer says why and what to set, and
    no byte (so no token) reached a pod."""
    certs = make_certificates(tmp_path / "tls", names=[], addresses=["127.0.0.1"])
    ports = [free_port(), free_port()]
    peers = tuple(f"127.0.0.1:{port}" for port in ports)
    async with (
        tls_cluster(tmp_path, certs, ["127.0.0.1"] * 2, ports, peers=peers, peers_scheme="https") as pods,
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
    ):
        status, body = await cluster_reset(http, pods[0])
        assert status == 502, body
        for part in body["pods"]:
            assert part["answer"] == "unreachable", part
            assert "TLS certificate did not verify" in part["error"], part
            assert "peers_ca_file" in part["error"], part
        for pod in pods:
            assert (await pod.engine.stats())["resets_total"] == 0
            assert (pod.front.handshakes, pod.front.bytes_in) == (0, 0)


async def test_pods_found_through_dns_are_verified_against_the_service_name(tmp_path: Path) -> None:
    """peers_dns resolves to pod IPs, but one certificate for the Service's name serves every pod."""
    certs = make_certificates(tmp_path / "tls", names=[SERVICE], addresses=[])
    hosts = ["127.0.0.1", "127.0.0.2"]
    port = shared_port(hosts)
    async with dns_server() as dns:
        dns.set(SERVICE, hosts)
        async with (
            tls_cluster(
                tmp_path,
                certs,
                hosts,
                [port, port],
                peers_dns=f"{SERVICE}:{port}",
                peers_dns_server=dns.address,
                peers_scheme="https",
                peers_ca_file=str(certs.ca),
            ) as pods,
            aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
        ):
            status, body = await cluster_reset(http, pods[1])
            assert status == 200, body
            assert sorted(p["pod"] for p in body["pods"]) == [f"{host}:{port}" for host in hosts]
            for pod in pods:
                assert (await pod.engine.stats())["resets_total"] == RESETS_PER_VERIFIED


def test_peers_ca_file_needs_https_and_a_loadable_ca(tmp_path: Path) -> None:
    """A CA file that would not be used, or cannot be, is refused at start."""
    certs = make_certificates(tmp_path / "tls", names=[], addresses=["127.0.0.1"])
    with pytest.raises(ConfigError, match="set peers_scheme = https"):
        load_settings({"peers_ca_file": str(certs.ca)}, env={})
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not a certificate\n")
    for path in (not_pem, tmp_path / "missing.pem"):
        with pytest.raises(ConfigError, match=r"peers_ca_file .* cannot be loaded"):
            load_settings({"peers_scheme": "https", "peers_ca_file": str(path)}, env={})
    assert (
        load_settings({"peers_scheme": "https", "peers_ca_file": str(certs.ca)}, env={}).peers_scheme
        == "https"
    )
