"""SimConfig, the simulator's options (docs/simulator.md); their command-line form is arguments.py."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_MODELS",
    "DEFAULT_VERSIONS",
    "DIALECTS",
    "RUST_FRONTENDS",
    "SCHEDULING_POLICIES",
    "SimConfig",
]

DIALECTS: tuple[str, ...] = ("vllm", "sglang", "llamacpp", "mindnano", "trtllm", "dynamo", "openai")
# The shapes of vLLM's GET /kv_event_sources (0.32: a dict keyed by rank).
KV_SOURCE_SHAPES: tuple[str, ...] = ("dict", "list", "sources")
# vLLM's Rust front end, as two of its versions answer a reset.
RUST_FRONTENDS: tuple[str, ...] = ("bare", "strict")
# vLLM's --scheduling-policy: with priority, a later request with a lower `priority` runs first.
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")

# The version each dialect reports when --version is not given.
DEFAULT_VERSIONS: dict[str, str] = {
    "vllm": "0.32.0",
    "sglang": "0.5.10",
    "llamacpp": "b6000-sim",
    "mindnano": "0.1.0-sim",
    "trtllm": "1.3.0rc29",
    "dynamo": "1.6.1",
    "openai": "sim",
}

# The model id each dialect serves when --model is not given.
DEFAULT_MODELS: dict[str, str] = {
    "vllm": "sim-model",
    "sglang": "sim-model",
    "llamacpp": "sim-model",
    "mindnano": "mindnano-ling3-tiny",
    "trtllm": "sim-model",
    "dynamo": "sim-model",
    "openai": "sim-model",
}
# Dialects with one prefix cache per rank (vllm, sglang: data-parallel ranks; dynamo: workers).
_RANKED = ("vllm", "sglang", "dynamo")
# Dialects whose reset can answer success and leave the cache warm (--reset-leaves-warm).
_FALSE_SUCCESS = ("vllm", "sglang", "trtllm", "dynamo")


@dataclass(frozen=True)
class SimConfig:
    """Every option of the simulated engine."""

    dialect: str = "vllm"
    model: str | None = None  # None: the dialect's default (DEFAULT_MODELS)
    version: str | None = None  # None: the dialect's default (DEFAULT_VERSIONS)
    decode_rate: float = 50.0  # tokens/s per sequence; 0 = unthrottled
    prefill_rate: float = 5000.0  # uncached prompt tokens/s; 0 = instant
    block_size: int = 16
    cache_blocks: int = 4096  # prefix-cache capacity in blocks (not mindnano: it holds one prompt)
    max_concurrency: int = 0  # running requests at once; 0 = unlimited; extra ones wait
    scheduling_policy: str = "fcfs"  # who of the waiting runs next: fcfs, or priority (lowest first)
    default_max_tokens: int = 16
    # Words split into 1 to 3 tokens (proxy/sim/text.py piece_tokenize), not one token per word.
    word_pieces: bool = False
    # Seconds an idle client connection stays open (uvicorn, under vLLM and SGLang: 5);
    # None: aiohttp's default.
    keepalive_timeout: float | None = None
    # Strict validation (an OpenAI-compatible server that forbids unknown fields): any
    # `stream_options` is a 400, so an injected one is refused.
    reject_stream_options: bool = False
    # A reset that answers success but clears nothing (vllm, sglang): as an engine whose
    # cache sits in a tier its reset does not reach, for tests of a contradicted reset.
    reset_leaves_warm: bool = False
    # vllm
    legacy_empty_body: bool = False
    dev_mode: bool = True
    prompt_tokens_details: bool = True
    omit_zero_cached: bool = False
    # A CPU-offload tier that /reset_prefix_cache leaves warm (vLLM #57727).
    host_tier: bool = False
    # vLLM's Rust front end (VLLM_USE_RUST_FRONTEND=1): `bare` answers every reset with a bare 200,
    # `strict` answers 409 to a refused one and 400 to reset_external=true without a connector.
    rust_frontend: str | None = None
    # A hybrid (Mamba-style) model: prefix-cache hits land only on multiples of this many tokens
    # (vllm: `mamba_block_size` and `cache_hit_alignment_tokens` of cache_config_info; sglang: page_size).
    hybrid_block_size: int | None = None
    # Data parallelism (vllm, sglang): one prefix cache per rank; requests go where the routing
    # hint says (vLLM's X-data-parallel-rank header, SGLang's too or its body fields), else round-robin.
    dp_size: int = 1
    # The rank whose cache every reset leaves warm, while the reset answers success (SGLang's
    # /flush_cache answers with the first rank's result only).
    refusing_rank: int | None = None
    # vllm: LMCache as the offload tier, its internal API servers on consecutive ports from
    # lmcache_port_start (scheduler, then one per worker); a clear that answers success and
    # removes nothing (LMCache #1692, #1693).
    lmcache: bool = False
    lmcache_port_start: int = 6999
    lmcache_workers: int = 1
    lmcache_leaves_warm: bool = False
    # trtllm, dynamo: a release without the reset route (404); trtllm: no return_perf_metrics (no /prometheus/metrics)
    reset_route: bool = True
    perf_metrics: bool = True
    # dynamo: the worker the frontend cannot reach (listed in failed_workers, its cache kept)
    unreachable_worker: int | None = None
    # sglang
    admin_api_key: str | None = None
    # SGLang #17648: `sglext.cached_tokens_details` when a request sets return_cached_tokens_details,
    # and `sglang:cached_tokens_total{cache_source}`.
    tier_details: bool = False
    # A HiCache storage tier (`file`, `mooncake`, ...): /flush_cache leaves it warm,
    # POST /hicache/storage-backend/clear empties it.
    hicache_storage_backend: str | None = None
    # llamacpp
    slots: int = 2
    slot_save_path: str | None = None
    ram_cache: bool = False
    sleep_idle_seconds: float | None = None  # --sleep-idle-seconds: unload model and KV when idle
    router_mode: bool = False  # no --model: a router over child servers, one per model
    # KV cache events (vllm, sglang): PUB to this address (connects; binds when it has `*`)
    kv_events_endpoint: str | None = None
    kv_events_replay: str | None = None  # the ROUTER that answers replays (bound)
    kv_events_topic: str = "kv"
    kv_events_rank: int = 0  # this engine's data-parallel rank: ports + rank, `dp_rank` in batches
    kv_events_legacy: bool = False  # vllm: positional arrays (the msgspec array_like releases)
    kv_events_drop_every: int = 0  # every Nth batch is not sent, only replayable (0: none)
    # The engine names its publishers (vllm: GET /kv_event_sources in this shape: dict keyed by
    # rank as 0.32, a bare list, or {"sources": [...]}; sglang: /server_info `kv_events`).
    kv_events_discovery: str | None = None

    def __post_init__(self) -> None:
        """Reject values no engine would start with."""
        if self.dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {', '.join(DIALECTS)}, not {self.dialect!r}")
        if self.decode_rate < 0 or self.prefill_rate < 0:
            raise ValueError("decode_rate and prefill_rate must be >= 0 (0 = unthrottled)")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.cache_blocks < 0:
            raise ValueError("cache_blocks must be >= 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        if self.max_concurrency < 0:
            raise ValueError("max_concurrency must be >= 0 (0 = unlimited)")
        if self.slots < 1:
            raise ValueError("slots must be >= 1")
        if self.keepalive_timeout is not None and self.keepalive_timeout <= 0:
            raise ValueError("keepalive_timeout must be > 0 seconds")
        if self.default_max_tokens < 0:
            raise ValueError("default_max_tokens must be >= 0")
        if self.dp_size < 1:
            raise ValueError("dp_size must be >= 1")
        if self.dp_size > 1 and self.dialect not in _RANKED:
            raise ValueError("--dp-size is for the vllm, sglang and dynamo dialects")
        if self.refusing_rank is not None and not 0 <= self.refusing_rank < self.dp_size:
            raise ValueError("--refusing-rank must be one of the ranks 0 .. dp_size-1")
        if (self.sleep_idle_seconds is not None or self.router_mode) and self.dialect != "llamacpp":
            raise ValueError("--sleep-idle-seconds and --router-mode are for the llamacpp dialect")
        if self.sleep_idle_seconds is not None and self.sleep_idle_seconds <= 0:
            raise ValueError("--sleep-idle-seconds must be > 0")
        if self.rust_frontend is not None and (
            self.dialect != "vllm" or self.rust_frontend not in RUST_FRONTENDS
        ):
            raise ValueError(f"--rust-frontend is for the vllm dialect, one of {', '.join(RUST_FRONTENDS)}")
        if self.hybrid_block_size is not None and (
            self.dialect not in ("vllm", "sglang") or self.hybrid_block_size < 1
        ):
            raise ValueError("--hybrid-block-size is for the vllm and sglang dialects, >= 1 tokens")
        if self.tier_details and self.dialect != "sglang":
            raise ValueError("--tier-details is for the sglang dialect")
        if self.hicache_storage_backend is not None and self.dialect != "sglang":
            raise ValueError("--hicache-storage-backend is for the sglang dialect")
        if self.word_pieces and self.dialect == "mindnano":
            raise ValueError("word_pieces is for the word-tokenizer dialects (mindnano counts characters)")
        if self.reset_leaves_warm and self.dialect not in _FALSE_SUCCESS:
            raise ValueError(
                "reset_leaves_warm is for the vllm, sglang, trtllm and dynamo dialects (llamacpp: ram_cache)"
            )
        self._check_engine_extras()
        self._check_kv_events()

    def _check_engine_extras(self) -> None:
        """The LMCache tier (vllm) and the dynamo worker options."""
        if self.lmcache and self.dialect != "vllm":
            raise ValueError("--lmcache is for the vllm dialect")
        if self.lmcache_workers < 1 or not 0 <= self.lmcache_port_start <= 65535 - self.lmcache_workers:
            raise ValueError("--lmcache-workers must be >= 1 and the LMCache ports within 0..65535")
        if self.unreachable_worker is not None and (
            self.dialect != "dynamo" or not 0 <= self.unreachable_worker < self.dp_size
        ):
            raise ValueError(
                "--unreachable-worker is for the dynamo dialect: one of the workers 0 .. dp_size-1"
            )

    def _check_kv_events(self) -> None:
        """KV events exist for vLLM and SGLang, over tcp, with a rank and a drop period >= 0."""
        uses = self.kv_events_endpoint is not None or self.kv_events_replay is not None
        if uses and self.dialect not in ("vllm", "sglang"):
            raise ValueError("KV cache events are published by the vllm and sglang dialects only")
        if self.kv_events_replay is not None and self.kv_events_endpoint is None:
            raise ValueError("--kv-events-replay needs --kv-events-endpoint")
        for addr in (self.kv_events_endpoint, self.kv_events_replay):
            if addr is not None and not (addr.startswith("tcp://") and addr.rpartition(":")[2].isdigit()):
                raise ValueError(f"a KV events address is tcp://HOST:PORT, not {addr!r}")
        if self.kv_events_discovery is not None:
            if self.kv_events_discovery not in KV_SOURCE_SHAPES:
                raise ValueError(f"--kv-events-discovery is one of {', '.join(KV_SOURCE_SHAPES)}")
            if self.kv_events_endpoint is None or "*" not in self.kv_events_endpoint:
                raise ValueError(
                    "--kv-events-discovery needs an endpoint the engine binds: tcp://*:PORT or tcp://*:0"
                )
        if self.kv_events_legacy and self.dialect != "vllm":
            raise ValueError("--kv-events-legacy is vLLM's older format")
        if self.kv_events_rank < 0 or self.kv_events_drop_every < 0:
            raise ValueError("--kv-events-rank and --kv-events-drop-every must be >= 0")

    @property
    def kv_events_format(self) -> str | None:
        """The dialect of events published (proxy/sim/kv_events.py FORMATS), None when off."""
        if self.kv_events_endpoint is None:
            return None
        if self.dialect == "vllm":
            return "vllm-legacy" if self.kv_events_legacy else "vllm"
        return "sglang"

    @property
    def served_model(self) -> str:
        """The model id the simulated engine serves."""
        return self.model if self.model is not None else DEFAULT_MODELS[self.dialect]

    @property
    def engine_version(self) -> str:
        """The version string the simulated engine reports."""
        return self.version if self.version is not None else DEFAULT_VERSIONS[self.dialect]
