"""Who the cluster is: the sidecars a `scope=cluster` call reaches, from a static list or a headless Service.

Kubernetes keeps the membership: a headless Service's name resolves to the addresses of
the ready pods, so the name is resolved again on every cluster call, never remembered.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import aiodns
import aiodns.error

from proxy.config import Settings, parse_listen

__all__ = ["DNS_TIMEOUT_S", "Peer", "PeerSet", "discover_peers", "peer_from_text"]

# One lookup, one try per nameserver: a cluster call should fail fast and say so, not hang.
DNS_TIMEOUT_S = 2.0


@dataclass(frozen=True, order=True)
class Peer:
    """One sidecar of the cluster, reached on its listen port (over TLS with scheme https).

    `tls_name` is the name its certificate is checked against when it is not `host`: the
    headless Service's, so one certificate for that name serves every pod, whatever its IP.
    """

    host: str
    port: int
    scheme: str = field(default="http", compare=False)
    tls_name: str | None = field(default=None, compare=False)

    @property
    def address(self) -> str:
        """`host:port` (IPv6 in brackets): the name a cluster answer gives the pod."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The sidecar's base URL."""
        return f"{self.scheme}://{self.address}"


@dataclass(frozen=True)
class PeerSet:
    """The peers of one cluster call and where they came from; `error` says why the set is empty."""

    peers: tuple[Peer, ...]
    source: str
    error: str | None = None
    hint: str | None = None


def peer_from_text(text: str, scheme: str = "http") -> Peer:
    """`HOST:PORT` (IPv6 as `[::1]:PORT`) as a Peer; raises ValueError."""
    host, port = parse_listen(text.strip())
    return Peer(host, port, scheme)


def _static(settings: Settings) -> PeerSet:
    """The `peers` list, as configured (a TLS certificate is checked against each HOST as given)."""
    return PeerSet(tuple(peer_from_text(text, settings.peers_scheme) for text in settings.peers), "peers")


def _dns_target(settings: Settings) -> tuple[str, int]:
    """The name to resolve and the port its pods listen on (`NAME:PORT`, else our own listen port)."""
    assert settings.peers_dns is not None
    name, _, port = settings.peers_dns.partition(":")
    return name, int(port) if port else settings.listen_port


def _nameservers(settings: Settings) -> list[str] | None:
    """c-ares' server list for `peers_dns_server` (IP or IP:PORT), None for the system's resolv.conf."""
    server = settings.peers_dns_server
    if not server:
        return None
    if server.startswith("[") or server.count(":") == 1:
        host, port = parse_listen(server)
        return [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    return [server]


async def _resolve(name: str, nameservers: list[str] | None) -> list[str]:
    """The A addresses of `name` (the AAAA ones when it has no A record), each once.

    One family only: a dual-stack headless Service lists every pod under both, and each pod
    must be reset (and read) once. A fresh c-ares channel per call: c-ares (>= 1.23) caches
    answers per channel for their TTL, which would keep a pod Kubernetes has already taken out.
    """
    resolver = aiodns.DNSResolver(nameservers=nameservers, timeout=DNS_TIMEOUT_S, tries=1)
    try:
        result = await resolver.getaddrinfo(name, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM)
    finally:
        await resolver.close()
    by_family: dict[int, list[str]] = {socket.AF_INET: [], socket.AF_INET6: []}
    for node in result.nodes:
        addresses = by_family.setdefault(node.family, [])
        address = node.addr[0].decode("ascii")
        if address not in addresses:
            addresses.append(address)
    return by_family[socket.AF_INET] or by_family[socket.AF_INET6]


async def _from_dns(settings: Settings) -> PeerSet:
    """The pods behind the headless Service, resolved now."""
    name, port = _dns_target(settings)
    source = f"peers_dns {name}"
    try:
        addresses = await _resolve(name, _nameservers(settings))
    except aiodns.error.DNSError as exc:
        reason = exc.args[1] if len(exc.args) > 1 else str(exc)
        return PeerSet(
            (),
            source,
            error=f"DNS lookup of {name} failed: {reason}",
            hint="check that the headless Service exists and has ready pods"
            + (f", and that {settings.peers_dns_server} answers DNS" if settings.peers_dns_server else ""),
        )
    if not addresses:
        return PeerSet(
            (), source, error=f"{name} resolved to no addresses", hint="no pod behind the Service is ready"
        )
    tls_name = name.rstrip(".") if settings.peers_scheme == "https" else None
    return PeerSet(
        tuple(Peer(address, port, settings.peers_scheme, tls_name) for address in addresses), source
    )


async def discover_peers(settings: Settings) -> PeerSet:
    """This call's peers: the static list, or the headless Service resolved now; empty with a reason."""
    if settings.peers:
        return _static(settings)
    if settings.peers_dns:
        return await _from_dns(settings)
    return PeerSet(
        (),
        "none",
        error="no peers are configured",
        hint="set peers (HOST:PORT,...) or peers_dns (a headless Service name) on every sidecar; "
        "the Helm chart sets CACHEWITNESS_PEERS_DNS",
    )
