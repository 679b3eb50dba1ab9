"""Settings: everything `cachewitness serve` is configured with, and the choices some take.

Every key's parser and how to fix a bad value are in the option table (options.py beside it);
loading (flag > env `CACHEWITNESS_*` > TOML file > default) and the cross-field checks are
in load.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from aiohttp import web

from proxy.vocabulary import IsolationMode, VerifyMode

__all__ = [
    "SETTINGS",
    "ConfigError",
    "EngineRoutes",
    "NativeResetAuth",
    "NativeResets",
    "Settings",
    "parse_listen",
    "resets_beside",
]


class EngineRoutes(StrEnum):
    """Who may call the engine's own control routes through the sidecar."""

    ADMIN = "admin"  # the admin rules of /cache/*: token, or trusted_peers when none is set
    OPEN = "open"  # anyone who reaches the sidecar (unsafe: the behaviour before issue 14)


class NativeResets(StrEnum):
    """What an intercepted engine reset route (vLLM /reset_prefix_cache, ...) runs."""

    ENGINE = "engine"  # the engine's own semantics: one attempt, no drain, its answer as given
    UNIFORM = "uniform"  # the uniform reset: drain, retries, coalescing (what a benchmark wants)


class NativeResetAuth(StrEnum):
    """What lets a caller through on the intercepted reset routes."""

    ADMIN = "admin"  # the admin rules only
    UPSTREAM_API_KEY = "upstream_api_key"  # also the engine's own key, as benchmark tools send it


class ConfigError(Exception):
    """A bad setting: the message names the key and says how to fix it."""


def resets_beside(evidence: Path) -> Path:
    """The default file of the reset records: `<stem>.resets.jsonl` beside the evidence file."""
    return evidence.with_name(f"{evidence.stem}.resets{evidence.suffix or '.jsonl'}")


@dataclass(frozen=True)
class Settings:
    """Everything `cachewitness serve` is configured with."""

    # The documented ports (README, the TOML example, the chart): the sidecar on 8000, the engine beside it on 8200.
    upstream: str = "http://127.0.0.1:8200"
    listen: str = "0.0.0.0:8000"
    engine: str = "auto"
    evidence: str = "./evidence/cachewitness.jsonl"
    evidence_stdout: bool = False
    evidence_max_bytes: int = 64 * 1024 * 1024
    evidence_keep: int = 5
    evidence_queue_max_bytes: int = 32 * 1024 * 1024
    # Reset records in a file of their own (proxy/evidence/log.py); None: beside `evidence`.
    evidence_resets_path: str | None = None
    evidence_resets_max_bytes: int = 16 * 1024 * 1024
    evidence_resets_keep: int = 5
    evidence_rejected_per_s: float = 100.0
    # The evidence's hash chain (proxy/evidence/chain.py): checkpoints, signed with this key when set.
    evidence_signing_key_file: str | None = None
    checkpoint_interval_s: float = 10.0
    admin_token: str | None = field(default=None, repr=False)
    admin_token_file: str | None = None
    # A first start on a laptop: write a new random token into admin_token_file when it is absent.
    admin_token_create: bool = False
    admin_open: bool = False
    # Who counts as local for admin routes while no admin token is set (proxy/admin/auth.py).
    trusted_peers: tuple[str, ...] = ("127.0.0.1", "::1")
    max_body_bytes: int = 64 * 1024 * 1024
    max_buffered_bytes: int = 256 * 1024 * 1024
    connect_timeout: float = 10.0
    read_timeout: float = 600.0
    upstream_connection_limit: int = 0
    upstream_keepalive_timeout: float = 4.0
    max_upstream_head_bytes: int = 64 * 1024
    health_interval: float = 1.0
    health_path: str | None = None
    shutdown_delay: float = 0.0
    grace_period: float = 30.0
    header_timeout: float = 10.0
    body_idle_timeout: float = 60.0
    body_timeout: float = 300.0
    max_connections: int = 4096
    max_connections_per_peer: int = 0
    keepalive_timeout: float = 75.0
    client_write_timeout: float = 60.0
    health_listen: str | None = None
    drain: bool = True
    drain_timeout: float = 30.0
    retry_seconds: float = 10.0
    reset_attempt_timeout: float = 30.0
    case_idle_s: float = 30.0
    # SGLang: also clear the HiCache storage tier at each reset, where the engine runs one.
    clear_storage_tier: bool = True
    # vLLM with LMCache: its internal API servers' base URLs, or ("auto",) to find them on the
    # upstream's host (proxy/engines/lmcache.py); each reset also clears LMCache there.
    lmcache_api: tuple[str, ...] = ()
    verify: VerifyMode | None = None  # None: both with kv_events_endpoint or discovery, else canary
    kv_events_endpoint: str | None = None
    kv_events_replay: str | None = None
    kv_events_ranks: int = 1
    kv_events_topic: str = "kv"
    kv_events_publishers: tuple[str, ...] | None = None  # None: the upstream's host
    # auto: without kv_events_endpoint, follow the publishers the engine names (vLLM
    # /kv_event_sources, SGLang /server_info), connecting to them; off: never ask.
    kv_events_discovery: str = "auto"
    inject_usage: bool = True
    # Every inference request isolated from the prefix cache (proxy/isolation/).
    isolation: IsolationMode = IsolationMode.NONE
    inject_usage_reprobe_seconds: float = 600.0
    observe: bool = True
    request_id_header: bool = False
    overhead_header: bool = False
    front: bool = True
    engine_api_key: str | None = field(default=None, repr=False)
    upstream_api_key: str | None = field(default=None, repr=False)
    upstream_api_key_file: str | None = None
    engine_routes: EngineRoutes = EngineRoutes.ADMIN
    extra_admin_paths: tuple[str, ...] = ()
    native_resets: NativeResets = NativeResets.ENGINE
    native_reset_auth: NativeResetAuth = NativeResetAuth.ADMIN
    reset_method: str = "POST"
    reset_path: str | None = None
    busy_statuses: tuple[int, ...] = (409, 429, 503)
    success_field: str | None = None
    metrics_models: tuple[str, ...] = ()
    metrics_max_models: int = 20
    upstream_metrics_timeout: float = 2.0
    log_level: str = "info"
    # Cluster scope (proxy/cluster/peers.py): a static list of sidecars, or a headless Service name.
    peers: tuple[str, ...] = ()
    peers_dns: str | None = None
    peers_dns_server: str | None = None
    peers_scheme: str = "http"
    peers_ca_file: str | None = None

    @property
    def listen_host(self) -> str:
        """Host part of `listen`."""
        return parse_listen(self.listen)[0]

    @property
    def listen_port(self) -> int:
        """Port part of `listen`."""
        return parse_listen(self.listen)[1]

    @property
    def resets_evidence(self) -> str:
        """Where reset records go: evidence_resets_path, else `<stem>.resets.jsonl` beside `evidence`.

        Beside it, so the one evidence volume (the Helm chart mounts one) holds both, and named so
        that it is never one of the evidence file's own rotations (`<name>.1` …).
        """
        if self.evidence_resets_path:
            return self.evidence_resets_path
        return str(resets_beside(Path(self.evidence)))

    @property
    def verify_default(self) -> VerifyMode:
        """`verify`, else both where the engine's KV events are (or may be) followed, canary otherwise."""
        if self.verify is not None:
            return VerifyMode(self.verify)  # a Settings built in code may hold the plain word
        # With discovery the events witness joins once the engine names its publishers.
        following = self.kv_events_endpoint or self.kv_events_discovery == "auto"
        return VerifyMode.BOTH if following else VerifyMode.CANARY

    @property
    def engine_key(self) -> str | None:
        """The engine's own API key: upstream_api_key, else the older name engine_api_key."""
        return self.upstream_api_key or self.engine_api_key

    @property
    def upstream_base(self) -> str:
        """The upstream URL without a trailing slash."""
        return self.upstream.rstrip("/")


SETTINGS = web.AppKey("settings", Settings)


def parse_listen(text: str) -> tuple[str, int]:
    """Split HOST:PORT (IPv6 as [::1]:PORT)."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(text)
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(text)
    return host.strip("[]"), port
