"""The option table: every key `cachewitness serve` takes, how its text is parsed, and how to fix a bad value.

The settings themselves are proxy/config.py's `Settings`; loading them (flag > env
`CACHEWITNESS_*` > TOML file > default) and the cross-field checks are proxy/config_load.py's.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from yarl import URL

from proxy.config import EngineRoutes, NativeResetAuth, NativeResets, parse_listen
from proxy.vocabulary import EngineKind, VerifyMode

__all__ = ["ENGINE_KINDS", "LOG_LEVELS", "OPTIONS", "Option", "url_option"]

# What `engine` may be set to: every kind the sidecar knows, or "auto" to detect it.
ENGINE_KINDS = ("auto", *(kind.value for kind in EngineKind if kind is not EngineKind.UNKNOWN))
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Option:
    """How one setting is parsed from text and checked."""

    name: str
    parse: Callable[[str], Any]
    help: str
    fix: str


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _positive_float(text: str) -> float:
    value = float(text)
    if value != value or value < 0:
        raise ValueError(text)
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _head_bytes(text: str) -> int:
    value = int(text)
    if value < 1024:
        raise ValueError(text)
    return value


def _interval(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(text)
    return value


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _zmq_address(text: str) -> str:
    if not text.startswith(("tcp://", "ipc://")):
        raise ValueError(text)
    return text


def url_option(text: str) -> str:
    url = URL(text)
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(text)
    return text


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(text)
        return text

    return parse


def _lmcache_api(text: str) -> tuple[str, ...]:
    if text.strip() == "auto":
        return ("auto",)
    return tuple(url_option(url) for url in _names(text))


def _peer_list(text: str) -> tuple[str, ...]:
    peers = _names(text)
    for peer in peers:
        if parse_listen(peer)[1] == 0:
            raise ValueError(text)
    return peers


_DNS_NAME = re.compile(
    r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


def _dns_name(text: str) -> str:
    name, _, port = text.partition(":")
    if not _DNS_NAME.fullmatch(name) or (port and not 0 < int(port) <= 65535):
        raise ValueError(text)
    return text


def _nameserver(text: str) -> str:
    host, port = (parse_listen(text)) if text.startswith("[") or text.count(":") == 1 else (text, 53)
    ipaddress.ip_address(host)
    if not 0 < port <= 65535:
        raise ValueError(text)
    return text


def _listen(text: str) -> str:
    parse_listen(text)
    return text


def _path(text: str) -> str:
    if not text:
        raise ValueError(text)
    return text


def _admin_paths(text: str) -> tuple[str, ...]:
    paths = _names(text)
    if any(not path.startswith("/") or "*" in path[:-1] or "%" in path for path in paths):
        raise ValueError(text)
    return paths


def _networks(text: str) -> tuple[str, ...]:
    """Addresses and CIDRs (`10.0.0.0/8`; host bits may be set), as written; none: nobody."""
    networks = _names(text)
    for network in networks:
        ipaddress.ip_network(network, strict=False)
    return networks


def _method(text: str) -> str:
    if text.upper() not in ("GET", "POST", "PUT", "DELETE"):
        raise ValueError(text)
    return text.upper()


def _http_path(text: str) -> str:
    if not text.startswith("/") or "%" in text:
        raise ValueError(text)
    return text


OPTIONS: tuple[Option, ...] = (
    Option("upstream", url_option, "engine base URL", "an http(s) URL such as http://127.0.0.1:8200"),
    Option("listen", _listen, "address to serve on", "HOST:PORT such as 0.0.0.0:8000"),
    Option("engine", _choice(ENGINE_KINDS), "engine dialect", "one of " + "|".join(ENGINE_KINDS)),
    Option("evidence", _path, "evidence JSONL path", "a file path such as ./evidence/cachewitness.jsonl"),
    Option("evidence_stdout", _bool, "also copy evidence lines to stdout", "true or false"),
    Option("evidence_max_bytes", _positive_int, "rotate the evidence file at this size", "a byte count"),
    Option("evidence_keep", _positive_int, "rotated evidence files kept", "a whole number ≥ 0"),
    Option(
        "evidence_queue_max_bytes",
        _positive_int,
        "evidence waiting for the disk, at most (past it new records are dropped, counted)",
        "a byte count",
    ),
    Option(
        "evidence_resets_path",
        _path,
        "file of the reset records (infer.cache_state, infer.cache_verification), which observation "
        "traffic cannot rotate away (default: <evidence stem>.resets.jsonl beside the evidence file)",
        "a file path such as ./evidence/cachewitness.resets.jsonl",
    ),
    Option(
        "evidence_resets_max_bytes",
        _positive_int,
        "rotate the reset records' file at this size",
        "a byte count",
    ),
    Option("evidence_resets_keep", _positive_int, "rotated reset-record files kept", "a whole number ≥ 0"),
    Option(
        "evidence_rejected_per_s",
        _positive_float,
        "records per second of requests the sidecar refused itself; the rest are counted as dropped (rate)",
        "a rate ≥ 0 (0 = no limit)",
    ),
    Option(
        "evidence_signing_key_file",
        _path,
        "Ed25519 private key (PEM) that signs the evidence checkpoints (cachewitness keygen makes one); "
        "unset: checkpoints are unsigned",
        "a readable PEM file path",
    ),
    Option(
        "checkpoint_interval_s",
        _interval,
        "seconds between evidence checkpoints (one in each file while records come, and one at shutdown)",
        "seconds > 0",
    ),
    Option("admin_token", str, "admin bearer token (prefer admin_token_file)", "a non-empty string"),
    Option("admin_token_file", _path, "file holding the admin bearer token", "a readable file path"),
    Option(
        "admin_token_create",
        _bool,
        "when admin_token_file does not exist, write a new random token into it (mode 0600)",
        "true or false",
    ),
    Option("admin_open", _bool, "let any client call /cache/* without a token", "true or false"),
    Option(
        "trusted_peers",
        _networks,
        "client addresses that may call admin routes while no admin token is set",
        "comma-separated addresses or CIDRs such as 127.0.0.1,::1,10.0.0.0/8 (empty: nobody)",
    ),
    Option("max_body_bytes", _positive_int, "largest request body accepted", "a byte count"),
    Option(
        "max_buffered_bytes",
        _positive_int,
        "request-body bytes held at once to be observed; a body past it streams unobserved",
        "a byte count",
    ),
    Option("connect_timeout", _positive_float, "seconds to connect to the upstream", "seconds ≥ 0"),
    Option("read_timeout", _positive_float, "seconds of upstream silence before 504", "seconds ≥ 0"),
    Option(
        "upstream_connection_limit",
        _positive_int,
        "upstream connections (0 = no limit)",
        "a whole number ≥ 0",
    ),
    Option(
        "upstream_keepalive_timeout",
        _positive_float,
        "seconds an idle upstream connection stays pooled (below the engine's own: uvicorn's is 5)",
        "seconds ≥ 0 (0 = never reuse)",
    ),
    Option(
        "max_upstream_head_bytes",
        _head_bytes,
        "largest answer head taken from the engine (past it: 502 upstream_bad_answer)",
        "a byte count ≥ 1024",
    ),
    Option(
        "health_interval",
        _positive_float,
        "seconds between upstream health probes (none while traffic is answered below 500)",
        "seconds > 0",
    ),
    Option(
        "health_path", _http_path, "upstream health path (unset: the dialect's)", "a path such as /health"
    ),
    Option("shutdown_delay", _positive_float, "seconds to stay up not-ready after SIGTERM", "seconds ≥ 0"),
    Option("grace_period", _positive_float, "seconds in-flight requests get at shutdown", "seconds ≥ 0"),
    Option(
        "header_timeout",
        _positive_float,
        "seconds a client gets to send a request head (0 = no limit)",
        "seconds ≥ 0",
    ),
    Option(
        "body_idle_timeout",
        _positive_float,
        "seconds a request body may stay silent (0 = no limit)",
        "seconds ≥ 0",
    ),
    Option(
        "body_timeout",
        _positive_float,
        "seconds a request body may take in all, not counting the sidecar's own pauses (0 = no limit)",
        "seconds ≥ 0",
    ),
    Option(
        "max_connections",
        _positive_int,
        "client connections open at once; more get 503 and close (0 = no limit)",
        "a whole number ≥ 0",
    ),
    Option(
        "max_connections_per_peer",
        _positive_int,
        "client connections open at once from one address; more get 503 and close (0 = no limit)",
        "a whole number ≥ 0",
    ),
    Option(
        "keepalive_timeout",
        _positive_float,
        "seconds an idle keep-alive client connection stays open (0 = close after each response)",
        "seconds ≥ 0",
    ),
    Option(
        "client_write_timeout",
        _positive_float,
        "seconds a client may take no bytes of its answer before it is cut (0 = no limit)",
        "seconds ≥ 0",
    ),
    Option(
        "health_listen",
        _listen,
        "extra address serving only /-/healthy and /-/ready, outside max_connections (unset: none)",
        "HOST:PORT such as 0.0.0.0:8001",
    ),
    Option("drain", _bool, "drain in-flight requests before a reset by default", "true or false"),
    Option("drain_timeout", _positive_float, "longest drain before a reset", "seconds ≥ 0"),
    Option("retry_seconds", _positive_float, "default retry window for refused resets", "seconds 0..120"),
    Option("reset_attempt_timeout", _positive_float, "timeout of one engine reset call", "seconds > 0"),
    Option("case_idle_s", _positive_float, "a case with no request this long has ended", "seconds > 0"),
    Option(
        "clear_storage_tier",
        _bool,
        "SGLang: each reset also clears the HiCache storage tier (POST /hicache/storage-backend/clear) "
        "where /server_info names a hicache_storage_backend",
        "true or false",
    ),
    Option(
        "lmcache_api",
        _lmcache_api,
        "vLLM with LMCache: each reset also clears LMCache (DELETE /cache/clear) at these internal API "
        "servers, or auto: the upstream host's ports from 6999 (LMCache's internal_api_server_port_start)",
        "auto, or comma-separated URLs such as http://127.0.0.1:7000,http://127.0.0.1:7001",
    ),
    Option(
        "verify",
        VerifyMode,
        "how a reset proves itself by default: canary (a private prompt cached before, cold after), "
        "events (the engine's KV cache events), both, or none (unset: both with kv_events_endpoint, else canary)",
        "canary, events, both or none",
    ),
    Option(
        "kv_events_endpoint",
        _zmq_address,
        "ZeroMQ address the sidecar binds for the engine's KV cache events (unset: no events witness)",
        "tcp://HOST:PORT such as tcp://127.0.0.1:5557",
    ),
    Option("kv_events_replay", _zmq_address, "the engine's KV events replay address", "tcp://HOST:PORT"),
    Option(
        "kv_events_ranks",
        _positive_int,
        "engine data-parallel ranks publishing KV events",
        "a whole number ≥ 1",
    ),
    Option("kv_events_topic", str, "the engine's KV events topic", "a topic such as kv"),
    Option(
        "kv_events_publishers",
        _names,
        "hosts whose publishers may connect to a tcp kv_events_endpoint the sidecar binds "
        "(unset: the upstream's host; others are refused in the handshake)",
        "comma-separated host names or addresses such as 127.0.0.1,10.0.0.7",
    ),
    Option("inject_usage", _bool, "add stream_options.include_usage to streams", "true or false"),
    Option(
        "inject_usage_reprobe_seconds",
        _positive_float,
        "seconds an engine that refused the injected include_usage goes uninjected before it is tried again",
        "seconds ≥ 0 (0 = try every stream)",
    ),
    Option("observe", _bool, "observe inference requests and write evidence", "true or false"),
    Option(
        "front",
        _bool,
        "serve plain inference requests on the front (httptools), without aiohttp's per-request machinery",
        "true or false",
    ),
    Option(
        "request_id_header",
        _bool,
        "add X-Request-Id toward the engine and the client when the client sent none",
        "true or false",
    ),
    Option(
        "overhead_header",
        _bool,
        "add X-Cachewitness-Overhead-Us (the sidecar's added microseconds) to each relayed answer",
        "true or false",
    ),
    Option("engine_api_key", str, "older name of upstream_api_key (kept working)", "a non-empty string"),
    Option(
        "upstream_api_key",
        str,
        "the engine's own API key, sent on control calls and the sidecar's own engine calls",
        "a non-empty string (prefer upstream_api_key_file)",
    ),
    Option("upstream_api_key_file", _path, "file holding upstream_api_key", "a readable file path"),
    Option(
        "engine_routes",
        EngineRoutes,
        "who may call the engine's control routes: admin (token/trusted_peers) or open (unsafe)",
        "admin or open",
    ),
    Option(
        "extra_admin_paths",
        _admin_paths,
        "more engine paths that need admin auth (a trailing * matches a prefix)",
        "comma-separated paths without % such as /my_admin,/debug/*",
    ),
    Option(
        "native_resets",
        NativeResets,
        "what an engine reset route called through the sidecar runs: engine (as the engine) or uniform",
        "engine or uniform",
    ),
    Option(
        "native_reset_auth",
        NativeResetAuth,
        "on intercepted reset routes also accept the engine's key (upstream_api_key) as the bearer",
        "admin or upstream_api_key",
    ),
    Option("reset_method", _method, "generic engine: reset HTTP method", "GET, POST, PUT or DELETE"),
    Option("reset_path", _http_path, "generic engine: reset path", "a path such as /reset"),
    Option("busy_statuses", _ints, "generic engine: statuses meaning refused", "comma-separated ints"),
    Option("success_field", str, "generic engine: JSON field that must be true", "a field name"),
    Option("metrics_models", _names, "model names allowed as metric labels", "comma-separated names"),
    Option("metrics_max_models", _positive_int, "most model label values", "a whole number ≥ 0"),
    Option(
        "upstream_metrics_timeout", _positive_float, "seconds to fetch the engine's /metrics", "seconds > 0"
    ),
    Option("log_level", _choice(LOG_LEVELS), "log level", "one of " + "|".join(LOG_LEVELS)),
    Option(
        "peers",
        _peer_list,
        "sidecars a scope=cluster call reaches, this one included",
        "comma-separated HOST:PORT such as 10.0.0.5:8000,10.0.0.6:8000",
    ),
    Option(
        "peers_dns",
        _dns_name,
        "headless Service name resolved to the peers on every cluster call",
        "a DNS name, optionally NAME:PORT (default port: the listen port)",
    ),
    Option(
        "peers_dns_server",
        _nameserver,
        "nameserver for peers_dns (default: the system's)",
        "an IP address, optionally IP:PORT such as 10.96.0.10:53",
    ),
    Option(
        "peers_scheme",
        _choice(("http", "https")),
        "how a cluster call reaches the peers (it carries the admin token): http, or https verified "
        "against peers_ca_file",
        "http or https",
    ),
    Option(
        "peers_ca_file",
        _path,
        "CA certificates (PEM) the peers' TLS certificates must chain to (default: the system's)",
        "a readable PEM file path",
    ),
)
