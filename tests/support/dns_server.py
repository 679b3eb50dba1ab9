"""A real DNS server for tests: dnslib answers A and AAAA records for names a test sets, on a loopback UDP port.

It runs in the test's event loop (an asyncio datagram endpoint), so a test can change
the answer between two calls and see who asked what.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord

# Long enough that a resolver which caches answers would keep a stale set between calls.
TTL_S = 300


@dataclass
class DnsServer:
    """The name → addresses table the server answers from, and the questions it was asked."""

    address: str
    records: dict[str, list[str]] = field(default_factory=dict)
    questions: list[tuple[str, str]] = field(default_factory=list)

    def set(self, name: str, addresses: list[str]) -> None:
        """Answer `name` with these A (IPv4) and AAAA (IPv6) records from now on (none: NOERROR, empty)."""
        self.records[name.rstrip(".") + "."] = list(addresses)

    def answer(self, query: bytes) -> bytes:
        """The reply to one query: the A or AAAA records of a known name (maybe none), else NXDOMAIN."""
        request = DNSRecord.parse(query)
        reply = request.reply()
        name = str(request.q.qname)
        self.questions.append((name, QTYPE[request.q.qtype]))
        if name not in self.records:
            reply.header.rcode = RCODE.NXDOMAIN
        else:
            for address in self.records[name]:
                version = ipaddress.ip_address(address).version
                if request.q.qtype == QTYPE.A and version == 4:
                    reply.add_answer(RR(name, QTYPE.A, rdata=A(address), ttl=TTL_S))
                elif request.q.qtype == QTYPE.AAAA and version == 6:
                    reply.add_answer(RR(name, QTYPE.AAAA, rdata=AAAA(address), ttl=TTL_S))
        packed: bytes = reply.pack()
        return packed


class _Protocol(asyncio.DatagramProtocol):
    """Hands each datagram to the server's table."""

    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The selector loop's datagram transport does not subclass DatagramTransport.
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.transport.sendto(self.server.answer(data), addr)


@asynccontextmanager
async def dns_server() -> AsyncIterator[DnsServer]:
    """A DNS server on 127.0.0.1 and a free UDP port; `server.address` is `127.0.0.1:PORT`."""
    loop = asyncio.get_running_loop()
    server = DnsServer(address="")
    transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(server), local_addr=("127.0.0.1", 0))
    server.address = "127.0.0.1:{}".format(transport.get_extra_info("sockname")[1])
    try:
        yield server
    finally:
        transport.close()
