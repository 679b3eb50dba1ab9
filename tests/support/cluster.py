"""A cluster for tests: pods (simulator + sidecar) on 127.0.0.1, .2, .3 … sharing one port, found through DNS."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.sim import SimConfig
from tests.support.client import CLIENT_TIMEOUT
from tests.support.dns_server import DnsServer, dns_server
from tests.support.evidence_files import evidence_records
from tests.support.sidecar import serve_sidecar
from tests.support.sim import Sim, chat, sim

SERVICE = "cw-peers.ns.svc.cluster.test"
TOKEN = "cluster-test-token"


def shared_port(hosts: list[str]) -> int:
    """A TCP port free on every one of `hosts` (bounded tries)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind((hosts[0], 0))
            port: int = first.getsockname()[1]
            others = [socket.socket() for _ in hosts[1:]]
            try:
                for sock, host in zip(others, hosts[1:], strict=True):
                    sock.bind((host, port))
                return port
            except OSError:
                continue
            finally:
                for sock in others:
                    sock.close()
    raise AssertionError("no port is free on every loopback address")


@dataclass
class Pod:
    """One pod: its engine, its sidecar, the sidecar's app and evidence file."""

    host: str
    engine: Sim
    url: str
    app: web.Application
    evidence: Path

    @property
    def address(self) -> str:
        """The name a cluster answer gives this pod."""
        return self.url.removeprefix("http://")

    def records(self) -> list[dict[str, Any]]:
        """This pod's own evidence records, both files (flushed by the reads that precede)."""
        return evidence_records(self.evidence)


@dataclass
class Cluster:
    """The pods, the DNS server, the shared port and a client."""

    pods: list[Pod]
    dns: DnsServer
    port: int
    http: aiohttp.ClientSession
    token: str | None = None

    def headers(self) -> dict[str, str]:
        """The admin token, when the pods have one."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def reset(
        self, body: dict[str, Any] | None = None, query: str = "?scope=cluster", via: int = 0
    ) -> tuple[int, dict[str, Any]]:
        """POST /cache/reset on one pod (the first by default); status and JSON body."""
        data = orjson.dumps(body) if body is not None else None
        url = f"{self.pods[via].url}/cache/reset{query}"
        async with self.http.post(url, data=data, headers=self.headers()) as resp:
            return resp.status, await resp.json()

    async def get(self, path: str, via: int = 0) -> tuple[int, bytes]:
        """GET a path from one pod; status and raw body."""
        async with self.http.get(f"{self.pods[via].url}{path}", headers=self.headers()) as resp:
            return resp.status, await resp.read()

    def serve(self, hosts: list[str]) -> None:
        """The headless Service now resolves to these pod addresses."""
        self.dns.set(SERVICE, hosts)


@asynccontextmanager
async def cluster(
    tmp_path: Path, configs: list[SimConfig], token: str | None = None, **overrides: Any
) -> AsyncIterator[Cluster]:
    """One pod per config on 127.0.0.(i+1), every sidecar finding the others through the DNS server."""
    hosts = [f"127.0.0.{index + 1}" for index in range(len(configs))]
    port = shared_port(hosts)
    async with AsyncExitStack() as stack:
        dns = await stack.enter_async_context(dns_server())
        dns.set(SERVICE, hosts)
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        pods: list[Pod] = []
        for index, (host, config) in enumerate(zip(hosts, configs, strict=True)):
            engine = await stack.enter_async_context(sim(config))
            evidence = tmp_path / f"pod{index}" / "cachewitness.jsonl"
            sidecar = await stack.enter_async_context(
                serve_sidecar(
                    engine.url,
                    tmp_path,
                    host=host,
                    port=port,
                    evidence=str(evidence),
                    peers_dns=f"{SERVICE}:{port}",
                    peers_dns_server=dns.address,
                    admin_token=token,
                    **overrides,
                )
            )
            url, app = sidecar.url, sidecar.app
            pods.append(Pod(host, engine, url, app, evidence))
        yield Cluster(pods, dns, port, http, token)


@asynccontextmanager
async def busy_engine(pod: Pod) -> AsyncIterator[None]:
    """A stream generating at the pod's engine for the whole block, sent straight to the engine so
    the sidecar's drain cannot wait it out (a vLLM engine then refuses its reset)."""
    stream = await pod.engine.http.post(
        pod.engine.url + "/v1/chat/completions", json=chat("busy", max_tokens=2000, stream=True)
    )
    try:
        await pod.engine.wait_stats(lambda stats: stats["running"] == 1)
        yield
    finally:
        stream.close()


# Engine resets per pod reset: its own, and one after each canary probe (proxy/witnesses/canary.py).
RESETS_PER_VERIFIED = 3
