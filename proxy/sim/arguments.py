"""The simulator's command-line arguments (the names of docs/cli.md) and the SimConfig they build."""

from __future__ import annotations

import argparse

from proxy.sim.config import DIALECTS, KV_SOURCE_SHAPES, RUST_FRONTENDS, SCHEDULING_POLICIES, SimConfig

__all__ = ["add_sim_arguments", "parse_listen", "sim_config_from_args"]


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
        help="vllm, sglang, trtllm, dynamo: the reset answers success but the cache stays warm",
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
    vllm.add_argument(
        "--lmcache", action="store_true", help="LMCache as the offload tier, with its internal API servers"
    )
    vllm.add_argument(
        "--lmcache-port-start",
        type=int,
        default=d.lmcache_port_start,
        metavar="PORT",
        help="LMCache's internal_api_server_port_start: the scheduler's port, then one per worker",
    )
    vllm.add_argument("--lmcache-workers", type=int, default=d.lmcache_workers, metavar="N")
    vllm.add_argument(
        "--lmcache-leaves-warm",
        action="store_true",
        help="DELETE /cache/clear answers success and removes nothing (LMCache #1692, #1693)",
    )
    parser.add_argument(
        "--dp-size",
        type=int,
        default=d.dp_size,
        metavar="N",
        help="vllm, sglang: data-parallel ranks; dynamo: workers behind the frontend",
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
        "--kv-events-discovery",
        choices=KV_SOURCE_SHAPES,
        default=None,
        help="the engine names its publishers: vllm GET /kv_event_sources in this shape; sglang /server_info",
    )
    kv.add_argument(
        "--kv-events-drop-every",
        type=int,
        default=d.kv_events_drop_every,
        metavar="N",
        help="do not send every Nth batch (it stays replayable): a gap to test",
    )
    trtllm = parser.add_argument_group("trtllm dialect")
    trtllm.add_argument(
        "--no-reset-route",
        action="store_true",
        help="trtllm, dynamo: a release without /reset_prefix_cache, /clear_kv_blocks (404)",
    )
    trtllm.add_argument(
        "--no-perf-metrics", action="store_true", help="no return_perf_metrics: /prometheus/metrics is 404"
    )
    dynamo = parser.add_argument_group("dynamo dialect")
    dynamo.add_argument(
        "--unreachable-worker",
        type=int,
        default=None,
        metavar="K",
        help="the worker /clear_kv_blocks cannot reach (in failed_workers; its cache kept)",
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
        lmcache=ns.lmcache,
        lmcache_port_start=ns.lmcache_port_start,
        lmcache_workers=ns.lmcache_workers,
        lmcache_leaves_warm=ns.lmcache_leaves_warm,
        reset_route=not ns.no_reset_route,
        perf_metrics=not ns.no_perf_metrics,
        unreachable_worker=ns.unreachable_worker,
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
        kv_events_discovery=ns.kv_events_discovery,
    )
