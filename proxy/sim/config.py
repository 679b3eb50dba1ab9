"""SimConfig, the simulator's options, and its command-line arguments (docs/simulator.md)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = ["DIALECTS", "SimConfig", "add_sim_arguments", "parse_listen", "sim_config_from_args"]

DIALECTS: tuple[str, ...] = ("vllm", "sglang", "llamacpp", "mindnano", "openai")
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
    "openai": "sim",
}

# The model id each dialect serves when --model is not given.
DEFAULT_MODELS: dict[str, str] = {
    "vllm": "sim-model",
    "sglang": "sim-model",
    "llamacpp": "sim-model",
    "mindnano": "mindnano-ling3-tiny",
    "openai": "sim-model",
}


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
        if self.dp_size > 1 and self.dialect not in ("vllm", "sglang"):
            raise ValueError("--dp-size is for the vllm and sglang dialects")
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
        if self.reset_leaves_warm and self.dialect not in ("vllm", "sglang"):
            raise ValueError("reset_leaves_warm is for the vllm and sglang dialects (llamacpp: ram_cache)")
        self._check_kv_events()

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


def parse_listen(value: str) -> tuple[str, int]:
    """Split `HOST:PORT` (IPv6 as `[::1]:8000`) into host and port."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen wants HOST:PORT, e.g. 127.0.0.1:8000, not {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's options (the names of docs/simulator.md) to an argparse parser."""
    d = SimConfig()
    parser.add_argument("--dialect", choices=DIALECTS, default=d.dialect, help="engine to speak like")
    # Kept as the raw "HOST:PORT" string (callers split it, e.g. with parse_listen).
    parser.add_argument(
        "--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="default 127.0.0.1:8000"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="served model name (default: sim-model; mindnano-ling3-tiny for mindnano)",
    )
    parser.add_argument("--version", dest="engine_version", default=None, help="engine version to report")
    parser.add_argument(
        "--decode-rate",
        type=float,
        default=d.decode_rate,
        metavar="TOKENS_PER_S",
        help="decode speed per sequence; 0 = unthrottled",
    )
    parser.add_argument(
        "--prefill-rate",
        type=float,
        default=d.prefill_rate,
        metavar="TOKENS_PER_S",
        help="prefill speed for uncached prompt tokens; 0 = instant",
    )
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument(
        "--cache-blocks", type=int, default=d.cache_blocks, help="prefix-cache capacity in blocks"
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=d.max_concurrency,
        help="running requests at once (0 = unlimited); extra ones wait",
    )
    parser.add_argument(
        "--keepalive-timeout",
        type=float,
        default=None,
        metavar="S",
        help="close a client connection idle this long (uvicorn: 5); default aiohttp's",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=d.scheduling_policy,
        help="who of the waiting requests runs next (priority: the request field `priority`, lowest first)",
    )
    parser.add_argument(
        "--reject-stream-options",
        action="store_true",
        help="strict validation: any stream_options is an unknown field (400)",
    )
    parser.add_argument(
        "--word-pieces",
        action="store_true",
        help="split words into 1 to 3 tokens (as a subword tokenizer), not one token per word",
    )
    parser.add_argument(
        "--reset-leaves-warm",
        action="store_true",
        help="vllm, sglang: the reset answers success but the cache stays warm",
    )
    vllm = parser.add_argument_group("vllm dialect")
    vllm.add_argument(
        "--legacy-empty-body",
        action="store_true",
        help="vLLM < 0.26: /reset_prefix_cache answers 200 with an empty body",
    )
    vllm.add_argument(
        "--no-dev-mode", action="store_true", help="no VLLM_SERVER_DEV_MODE: /reset_prefix_cache is 404"
    )
    vllm.add_argument(
        "--no-prompt-tokens-details",
        action="store_true",
        help="no --enable-prompt-tokens-details: usage has no cached-token field",
    )
    vllm.add_argument(
        "--omit-zero-cached", action="store_true", help="vLLM <= 0.14: cached_tokens omitted when 0"
    )
    vllm.add_argument(
        "--rust-frontend",
        choices=RUST_FRONTENDS,
        default=None,
        help="VLLM_USE_RUST_FRONTEND=1: resets answer a bare 200 (bare), or 409/400 (strict)",
    )
    parser.add_argument(
        "--hybrid-block-size",
        type=int,
        default=None,
        metavar="N",
        help="vllm, sglang: a hybrid model whose cache hits land on multiples of N tokens only",
    )
    vllm.add_argument(
        "--host-tier",
        action="store_true",
        help="a CPU-offload (host) tier that /reset_prefix_cache leaves warm",
    )
    parser.add_argument(
        "--dp-size", type=int, default=d.dp_size, metavar="N", help="vllm, sglang: data-parallel ranks"
    )
    parser.add_argument(
        "--refusing-rank",
        type=int,
        default=None,
        metavar="K",
        help="vllm, sglang: the rank whose cache every reset leaves warm (the reset still answers success)",
    )
    sglang = parser.add_argument_group("sglang dialect")
    sglang.add_argument("--admin-api-key", default=None, help="/flush_cache needs this bearer key")
    sglang.add_argument(
        "--tier-details",
        action="store_true",
        help="cached tokens per tier: sglext.cached_tokens_details, cached_tokens_total{cache_source}",
    )
    sglang.add_argument(
        "--hicache-storage-backend",
        default=None,
        metavar="NAME",
        help="a HiCache storage tier that /flush_cache leaves warm (file: the disk tier)",
    )
    kv = parser.add_argument_group("KV cache events (vllm, sglang)")
    kv.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ADDR",
        help="publish KV cache events (PUB) to tcp://HOST:PORT: connects, binds when HOST is *",
    )
    kv.add_argument(
        "--kv-events-replay", default=None, metavar="ADDR", help="bind the replay socket (ROUTER) here"
    )
    kv.add_argument("--kv-events-topic", default=d.kv_events_topic, help="topic frame (default kv)")
    kv.add_argument(
        "--kv-events-rank",
        type=int,
        default=d.kv_events_rank,
        metavar="R",
        help="this engine's data-parallel rank: both ports + R, and the batches' rank",
    )
    kv.add_argument(
        "--kv-events-legacy", action="store_true", help="vllm: positional arrays (older vLLM releases)"
    )
    kv.add_argument(
        "--kv-events-drop-every",
        type=int,
        default=d.kv_events_drop_every,
        metavar="N",
        help="do not send every Nth batch (it stays replayable): a gap to test",
    )
    llama = parser.add_argument_group("llamacpp dialect")
    llama.add_argument("--slots", type=int, default=d.slots, help="number of slots (-np)")
    llama.add_argument(
        "--slot-save-path", default=None, metavar="DIR", help="enables POST /slots/{id}?action="
    )
    llama.add_argument(
        "--ram-cache",
        action="store_true",
        help="host-RAM prompt cache that survives slot erase (llama-server --cache-ram)",
    )
    llama.add_argument(
        "--sleep-idle-seconds",
        type=float,
        default=None,
        metavar="S",
        help="unload model and KV after S idle seconds; /props says is_sleeping",
    )
    llama.add_argument(
        "--router-mode",
        action="store_true",
        help="a router over models (no --model): /slots and /metrics want ?model=",
    )


def sim_config_from_args(ns: argparse.Namespace) -> SimConfig:
    """Build a SimConfig from the namespace that add_sim_arguments' parser produced."""
    return SimConfig(
        dialect=ns.dialect,
        model=ns.model,
        version=ns.engine_version,
        decode_rate=ns.decode_rate,
        prefill_rate=ns.prefill_rate,
        block_size=ns.block_size,
        cache_blocks=ns.cache_blocks,
        max_concurrency=ns.max_concurrency,
        keepalive_timeout=ns.keepalive_timeout,
        reject_stream_options=ns.reject_stream_options,
        reset_leaves_warm=ns.reset_leaves_warm,
        word_pieces=ns.word_pieces,
        scheduling_policy=ns.scheduling_policy,
        legacy_empty_body=ns.legacy_empty_body,
        dev_mode=not ns.no_dev_mode,
        prompt_tokens_details=not ns.no_prompt_tokens_details,
        omit_zero_cached=ns.omit_zero_cached,
        host_tier=ns.host_tier,
        rust_frontend=ns.rust_frontend,
        hybrid_block_size=ns.hybrid_block_size,
        dp_size=ns.dp_size,
        refusing_rank=ns.refusing_rank,
        admin_api_key=ns.admin_api_key,
        tier_details=ns.tier_details,
        hicache_storage_backend=ns.hicache_storage_backend,
        slots=ns.slots,
        slot_save_path=ns.slot_save_path,
        ram_cache=ns.ram_cache,
        sleep_idle_seconds=ns.sleep_idle_seconds,
        router_mode=ns.router_mode,
        kv_events_endpoint=ns.kv_events_endpoint,
        kv_events_replay=ns.kv_events_replay,
        kv_events_topic=ns.kv_events_topic,
        kv_events_rank=ns.kv_events_rank,
        kv_events_legacy=ns.kv_events_legacy,
        kv_events_drop_every=ns.kv_events_drop_every,
    )
