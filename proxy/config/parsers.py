"""Each option's parser: text in, the value out, ValueError (with the text) when it is not one.

The option table (options.py beside it) names the parser of every key and how to fix a bad value.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

from yarl import URL

from proxy.config.settings import parse_listen

__all__ = [
    "listen_option",
    "parse_admin_paths",
    "parse_bool",
    "parse_choice",
    "parse_dns_name",
    "parse_head_bytes",
    "parse_http_path",
    "parse_interval",
    "parse_ints",
    "parse_lmcache_api",
    "parse_method",
    "parse_names",
    "parse_nameserver",
    "parse_networks",
    "parse_path",
    "parse_peer_list",
    "parse_positive_float",
    "parse_positive_int",
    "parse_zmq_address",
    "url_option",
]


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def parse_positive_float(text: str) -> float:
    value = float(text)
    if value != value or value < 0:
        raise ValueError(text)
    return value


def parse_positive_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def parse_head_bytes(text: str) -> int:
    value = int(text)
    if value < 1024:
        raise ValueError(text)
    return value


def parse_interval(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(text)
    return value


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def parse_names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_zmq_address(text: str) -> str:
    if not text.startswith(("tcp://", "ipc://")):
        raise ValueError(text)
    return text


def url_option(text: str) -> str:
    url = URL(text)
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(text)
    return text


def parse_choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(text)
        return text

    return parse


def parse_lmcache_api(text: str) -> tuple[str, ...]:
    if text.strip() == "auto":
        return ("auto",)
    return tuple(url_option(url) for url in parse_names(text))


def parse_peer_list(text: str) -> tuple[str, ...]:
    peers = parse_names(text)
    for peer in peers:
        if parse_listen(peer)[1] == 0:
            raise ValueError(text)
    return peers


_DNS_NAME = re.compile(
    r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


def parse_dns_name(text: str) -> str:
    name, _, port = text.partition(":")
    if not _DNS_NAME.fullmatch(name) or (port and not 0 < int(port) <= 65535):
        raise ValueError(text)
    return text


def parse_nameserver(text: str) -> str:
    host, port = (parse_listen(text)) if text.startswith("[") or text.count(":") == 1 else (text, 53)
    ipaddress.ip_address(host)
    if not 0 < port <= 65535:
        raise ValueError(text)
    return text


def listen_option(text: str) -> str:
    parse_listen(text)
    return text


def parse_path(text: str) -> str:
    if not text:
        raise ValueError(text)
    return text


def parse_admin_paths(text: str) -> tuple[str, ...]:
    paths = parse_names(text)
    if any(not path.startswith("/") or "*" in path[:-1] or "%" in path for path in paths):
        raise ValueError(text)
    return paths


def parse_networks(text: str) -> tuple[str, ...]:
    """Addresses and CIDRs (`10.0.0.0/8`; host bits may be set), as written; none: nobody."""
    networks = parse_names(text)
    for network in networks:
        ipaddress.ip_network(network, strict=False)
    return networks


def parse_method(text: str) -> str:
    if text.upper() not in ("GET", "POST", "PUT", "DELETE"):
        raise ValueError(text)
    return text.upper()


def parse_http_path(text: str) -> str:
    if not text.startswith("/") or "%" in text:
        raise ValueError(text)
    return text
