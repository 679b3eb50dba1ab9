"""Loopback ports for servers a test starts later than it picks their port: below the ephemeral range."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["fixed_ports"]

# Ports chosen here start at this one (above the registered services most machines run).
_FIXED_PORTS_FROM = 20000


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return max(low, _FIXED_PORTS_FROM + 1000)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def fixed_ports(n: int = 1) -> int:
    """The first of `n` consecutive loopback TCP ports that were free a moment ago, below the
    kernel's ephemeral range.

    A server that binds its port after it is chosen (an engine seconds later; a simulator's
    ZeroMQ sockets once its app starts) must not get one from the ephemeral range (what binding
    port 0 gives): meanwhile any socket on the machine can be given it, the client connections
    of the tests and engines running beside among them. One below the range is only ever taken
    by asking for it. (CI saw both: a test server answering vLLM's `/health` on vLLM's port, and
    a simulator's KV-events replay socket finding its port taken.)
    """
    low = _ephemeral_low()
    for _ in range(200):
        base = random.randrange(_FIXED_PORTS_FROM, low - n)
        if all(_bindable(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no run of {n} free ports in {_FIXED_PORTS_FROM}-{low - 1}")
