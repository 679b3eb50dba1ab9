"""The option table: every key `cachewitness serve` takes, how its text is parsed, and how to fix a bad value.

The settings themselves are `proxy.config.Settings`; loading them (flag > env `CACHEWITNESS_*`
> TOML file > default) and the cross-field checks are load.py's, beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.config.parsers import (
    listen_option,
    parse_admin_paths,
    parse_bool,
    parse_choice,
    parse_dns_name,
    parse_head_bytes,
    parse_http_path,
    parse_interval,
    parse_ints,
    parse_lmcache_api,
    parse_method,
    parse_names,
    parse_nameserver,
    parse_networks,
    parse_path,
    parse_peer_list,
    parse_positive_float,
    parse_positive_int,
    parse_zmq_address,
    url_option,
)
from proxy.config.settings import EngineRoutes, NativeResetAuth, NativeResets
from proxy.vocabulary import EngineKind, IsolationMode, VerifyMode

__all__ = ["ENGINE_KINDS", "LOG_LEVELS", "OPTIONS", "Option"]

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


OPTIONS: tuple[Option, ...] = (
    Option("upstream", url_option, "engine base URL", "an http(s) URL such as http://127.0.0.1:8200"),
    Option("listen", listen_option, "address to serve on", "HOST:PORT such as 0.0.0.0:8000"),
    Option("engine", parse_choice(ENGINE_KINDS), "engine dialect", "one of " + "|".join(ENGINE_KINDS)),
    Option(
        "evidence", parse_path, "evidence JSONL path", "a file path such as ./evidence/cachewitness.jsonl"
    ),
    Option("evidence_stdout", parse_bool, "also copy evidence lines to stdout", "true or false"),
    Option("evidence_max_bytes", parse_positive_int, "rotate the evidence file at this size", "a byte count"),
    Option("evidence_keep", parse_positive_int, "rotated evidence files kept", "a whole number ≥ 0"),
    Option(
        "evidence_queue_max_bytes",
        parse_positive_int,
        "evidence waiting for the disk, at most (past it new records are dropped, counted)",
        "a byte count",
    ),
    Option(
        "evidence_resets_path",
        parse_path,
        "file of the reset records (infer.cache_state, infer.cache_verification), which observation "
        "traffic cannot rotate away (default: <evidence stem>.resets.jsonl beside the evidence file)",
        "a file path such as ./evidence/cachewitness.resets.jsonl",
    ),
    Option(
        "evidence_resets_max_bytes",
        parse_positive_int,
        "rotate the reset records' file at this size",
        "a byte count",
    ),
    Option(
        "evidence_resets_keep", parse_positive_int, "rotated reset-record files kept", "a whole number ≥ 0"
    ),
    Option(
        "evidence_rejected_per_s",
        parse_positive_float,
        "records per second of requests the sidecar refused itself; the rest are counted as dropped (rate)",
        "a rate ≥ 0 (0 = no limit)",
    ),
    Option(
        "evidence_signing_key_file",
        parse_path,
        "Ed25519 private key (PEM) that signs the evidence checkpoints (cachewitness keygen makes one); "
        "unset: checkpoints are unsigned",
        "a readable PEM file path",
    ),
    Option(
        "checkpoint_interval_s",
        parse_interval,
        "seconds between evidence checkpoints (one in each file while records come, and one at shutdown)",
        "seconds > 0",
    ),
    Option("admin_token", str, "admin bearer token (prefer admin_token_file)", "a non-empty string"),
    Option("admin_token_file", parse_path, "file holding the admin bearer token", "a readable file path"),
    Option(
        "admin_token_create",
        parse_bool,
        "when admin_token_file does not exist, write a new random token into it (mode 0600)",
        "true or false",
    ),
    Option("admin_open", parse_bool, "let any client call /cache/* without a token", "true or false"),
    Option(
        "trusted_peers",
        parse_networks,
        "client addresses that may call admin routes while no admin token is set",
        "comma-separated addresses or CIDRs such as 127.0.0.1,::1,10.0.0.0/8 (empty: nobody)",
    ),
    Option("max_body_bytes", parse_positive_int, "largest request body accepted", "a byte count"),
    Option(
        "max_buffered_bytes",
        parse_positive_int,
        "request-body bytes held at once to be observed; a body past it streams unobserved",
        "a byte count",
    ),
    Option("connect_timeout", parse_positive_float, "seconds to connect to the upstream", "seconds ≥ 0"),
    Option("read_timeout", parse_positive_float, "seconds of upstream silence before 504", "seconds ≥ 0"),
    Option(
        "upstream_connection_limit",
        parse_positive_int,
        "upstream connections (0 = no limit)",
        "a whole number ≥ 0",
    ),
    Option(
        "upstream_keepalive_timeout",
        parse_positive_float,
        "seconds an idle upstream connection stays pooled (below the engine's own: uvicorn's is 5)",
        "seconds ≥ 0 (0 = never reuse)",
    ),
    Option(
        "max_upstream_head_bytes",
        parse_head_bytes,
        "largest answer head taken from the engine (past it: 502 upstream_bad_answer)",
        "a byte count ≥ 1024",
    ),
    Option(
        "health_interval",
        parse_positive_float,
        "seconds between upstream health probes (none while traffic is answered below 500)",
        "seconds > 0",
    ),
    Option(
        "health_path",
        parse_http_path,
        "upstream health path (unset: the dialect's)",
        "a path such as /health",
    ),
    Option(
        "shutdown_delay", parse_positive_float, "seconds to stay up not-ready after SIGTERM", "seconds ≥ 0"
    ),
    Option("grace_period", parse_positive_float, "seconds in-flight requests get at shutdown", "seconds ≥ 0"),
    Option(
        "header_timeout",
        parse_positive_float,
        "seconds a client gets to send a request head (0 = no limit)",
        "seconds ≥ 0",
    ),
    Option(
        "body_idle_timeout",
        parse_positive_float,
        "seconds a request body may stay silent (0 = no limit)",
        "seconds ≥ 0",
    ),
    Option(
        "body_timeout",
        parse_positive_float,
        "seconds a request body may take in all, not counting the sidecar's own pauses (0 = no limit)",
        "seconds ≥ 0",
    ),
    Option(
        "max_connections",
        parse_positive_int,
        "client connections open at once; more get 503 and close (0 = no limit)",
        "a whole number ≥ 0",
    ),
    Option(
        "max_connections_per_peer",
        parse_positive_int,
        "client connections open at once from one address; more get 503 and close (0 = no limit)",
        "a whole number ≥ 0",
    ),
    Option(
        "keepalive_timeout",
        parse_positive_float,
        "seconds an idle keep-alive client connection stays open (0 = close after each response)",
        "seconds ≥ 0",
    ),
    Option(
        "client_write_timeout",
        parse_positive_float,
        "seconds a client may take no bytes of its answer before it is cut (0 = no limit)",
        "seconds ≥ 0",
    ),
    Option(
        "health_listen",
        listen_option,
        "extra address serving only /-/healthy and /-/ready, outside max_connections (unset: none)",
        "HOST:PORT such as 0.0.0.0:8001",
    ),
    Option("drain", parse_bool, "drain in-flight requests before a reset by default", "true or false"),
    Option("drain_timeout", parse_positive_float, "longest drain before a reset", "seconds ≥ 0"),
    Option(
        "retry_seconds", parse_positive_float, "default retry window for refused resets", "seconds 0..120"
    ),
    Option("reset_attempt_timeout", parse_positive_float, "timeout of one engine reset call", "seconds > 0"),
    Option("case_idle_s", parse_positive_float, "a case with no request this long has ended", "seconds > 0"),
    Option(
        "clear_storage_tier",
        parse_bool,
        "SGLang: each reset also clears the HiCache storage tier (POST /hicache/storage-backend/clear) "
        "where /server_info names a hicache_storage_backend",
        "true or false",
    ),
    Option(
        "lmcache_api",
        parse_lmcache_api,
        "vLLM with LMCache: each reset also clears LMCache (DELETE /cache/clear) at these internal API "
        "servers, or auto: the upstream host's ports from 6999 (LMCache's internal_api_server_port_start)",
        "auto, or comma-separated URLs such as http://127.0.0.1:7000,http://127.0.0.1:7001",
    ),
    Option(
        "verify",
        VerifyMode,
        "how a reset proves itself by default: canary (a private prompt cached before, cold after), "
        "events (the engine's KV cache events), both, or none (unset: both with kv_events_endpoint or "
        "kv_events_discovery auto, else canary)",
        "canary, events, both or none",
    ),
    Option(
        "kv_events_endpoint",
        parse_zmq_address,
        "ZeroMQ address the sidecar binds for the engine's KV cache events (unset: no events witness)",
        "tcp://HOST:PORT such as tcp://127.0.0.1:5557",
    ),
    Option("kv_events_replay", parse_zmq_address, "the engine's KV events replay address", "tcp://HOST:PORT"),
    Option(
        "kv_events_ranks",
        parse_positive_int,
        "engine data-parallel ranks publishing KV events",
        "a whole number ≥ 1",
    ),
    Option("kv_events_topic", str, "the engine's KV events topic", "a topic such as kv"),
    Option(
        "kv_events_discovery",
        parse_choice(("auto", "off")),
        "without kv_events_endpoint, follow the KV event publishers the engine names "
        "(vLLM GET /kv_event_sources, SGLang /server_info), connecting to them",
        "auto or off",
    ),
    Option(
        "kv_events_publishers",
        parse_names,
        "hosts whose publishers may connect to a tcp kv_events_endpoint the sidecar binds "
        "(unset: the upstream's host; others are refused in the handshake)",
        "comma-separated host names or addresses such as 127.0.0.1,10.0.0.7",
    ),
    Option(
        "isolation",
        IsolationMode,
        "request: every inference request is isolated from the engine's prefix cache and proven cold "
        "(a fresh cache_salt, or cache_prompt false); none: only those that ask (header, case)",
        "none or request",
    ),
    Option("inject_usage", parse_bool, "add stream_options.include_usage to streams", "true or false"),
    Option(
        "inject_usage_reprobe_seconds",
        parse_positive_float,
        "seconds an engine that refused the injected include_usage goes uninjected before it is tried again",
        "seconds ≥ 0 (0 = try every stream)",
    ),
    Option("observe", parse_bool, "observe inference requests and write evidence", "true or false"),
    Option(
        "front",
        parse_bool,
        "serve plain inference requests on the front (httptools), without aiohttp's per-request machinery",
        "true or false",
    ),
    Option(
        "request_id_header",
        parse_bool,
        "add X-Request-Id toward the engine and the client when the client sent none",
        "true or false",
    ),
    Option(
        "overhead_header",
        parse_bool,
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
    Option("upstream_api_key_file", parse_path, "file holding upstream_api_key", "a readable file path"),
    Option(
        "engine_routes",
        EngineRoutes,
        "who may call the engine's control routes: admin (token/trusted_peers) or open (unsafe)",
        "admin or open",
    ),
    Option(
        "extra_admin_paths",
        parse_admin_paths,
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
    Option("reset_method", parse_method, "generic engine: reset HTTP method", "GET, POST, PUT or DELETE"),
    Option("reset_path", parse_http_path, "generic engine: reset path", "a path such as /reset"),
    Option("busy_statuses", parse_ints, "generic engine: statuses meaning refused", "comma-separated ints"),
    Option("success_field", str, "generic engine: JSON field that must be true", "a field name"),
    Option("metrics_models", parse_names, "model names allowed as metric labels", "comma-separated names"),
    Option("metrics_max_models", parse_positive_int, "most model label values", "a whole number ≥ 0"),
    Option(
        "upstream_metrics_timeout",
        parse_positive_float,
        "seconds to fetch the engine's /metrics",
        "seconds > 0",
    ),
    Option("log_level", parse_choice(LOG_LEVELS), "log level", "one of " + "|".join(LOG_LEVELS)),
    Option(
        "peers",
        parse_peer_list,
        "sidecars a scope=cluster call reaches, this one included",
        "comma-separated HOST:PORT such as 10.0.0.5:8000,10.0.0.6:8000",
    ),
    Option(
        "peers_dns",
        parse_dns_name,
        "headless Service name resolved to the peers on every cluster call",
        "a DNS name, optionally NAME:PORT (default port: the listen port)",
    ),
    Option(
        "peers_dns_server",
        parse_nameserver,
        "nameserver for peers_dns (default: the system's)",
        "an IP address, optionally IP:PORT such as 10.96.0.10:53",
    ),
    Option(
        "peers_scheme",
        parse_choice(("http", "https")),
        "how a cluster call reaches the peers (it carries the admin token): http, or https verified "
        "against peers_ca_file",
        "http or https",
    ),
    Option(
        "peers_ca_file",
        parse_path,
        "CA certificates (PEM) the peers' TLS certificates must chain to (default: the system's)",
        "a readable PEM file path",
    ),
)
