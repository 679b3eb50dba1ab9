"""The canary that proves a reset at reset time (docs/reset.md).

Inside the reset's drain window — nothing else reaches the engine — a private prompt C1
is sent twice (the repeat must show C1 cached: the engine caches prompts and says so),
then a different prompt C2, so that C1 is pushed toward any lower tier (llama.cpp's
host-RAM prompt cache, an offload tier). After the engine reset each canary is probed:
0 cached tokens on both is `verified`, more than 0 on either is `contradicted`. The
engine is reset between the two probes and once more at the end, so no canary token can
show up as cached in a later request (SGLang and llama.cpp match per token, and the two
canaries share their chat template's first tokens).

Canary prompts are fresh random words per reset, never logged, sized by the engine's own
tokens (proxy/witnesses/canary_size.py); the answer's `calls` list each canary request, and
each count of its words on the engine's tokenizer route, with token counts only. Canary requests go straight to
the engine, not through `forward`: they are no client traffic (no observation, no
ordinal, no request metrics).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson

from proxy.engines.base import CacheReset
from proxy.engines.call import EngineCall, bearer, engine_call
from proxy.engines.queries import fetch_model_ids
from proxy.observe import usage_from_json
from proxy.vocabulary import CanaryOutcome, EngineKind, Verified, VerifyMode
from proxy.witnesses.canary_blocks import engine_block_size
from proxy.witnesses.canary_size import (
    FIT_ROUNDS,
    CanaryFit,
    Sized,
    count_in_answer,
    fit_words,
    learn_template,
    resized,
    tokenize_request,
)
from proxy.witnesses.counters import Sums
from proxy.witnesses.tiers import tier_delta, tier_sum
from proxy.witnesses.verification import Reading, Verification

__all__ = [
    "DEFAULT_CANARY_TOKENS",
    "MOST_CANARY_CALLS",
    "RANK_HEADER",
    "Canary",
    "CanaryFit",
    "ResetCall",
    "verify_reset",
]


# Without a block size from the engine (docs/reset.md): long enough for any block we know of.
DEFAULT_CANARY_TOKENS = 512
# vLLM's data-parallel routing header (vllm/entrypoints/generate/base/serving.py); SGLang reads it too.
RANK_HEADER = "X-data-parallel-rank"
# Engine calls of one canary besides its resets, each bounded: C1, C1 resized, C1 again, C2, two
# probes, and the counts of C1's and C2's words.
MOST_CANARY_CALLS = 6 + 2 * FIT_ROUNDS
# The first letters of C1's and C2's first words: the two differ from their first token on.
_C1_LETTERS = "abcdefghijklm"
_C2_LETTERS = "nopqrstuvwxyz"
# The engine flag that makes it report cached tokens.
_REPORT_FLAGS: dict[str, str] = {
    EngineKind.VLLM: "start vLLM with --enable-prompt-tokens-details",
    EngineKind.SGLANG: "start SGLang with --enable-cache-report",
}
_CONTRADICTED_HINTS: dict[str, str] = {
    EngineKind.LLAMACPP: (
        "llama.cpp's host-RAM prompt cache survives slot erase and no endpoint clears it: "
        "start llama-server with --cache-ram 0"
    ),
    EngineKind.VLLM: (
        "a KV connector or CPU-offload tier kept the canary: use vLLM >= 0.13 (reset_external) "
        "or switch the offload tier off"
    ),
}
_DEFAULT_HINT = "the engine's reset left the canary cached: check the engine's cache tiers and reset route"


async def _no_tiers() -> Mapping[str, int] | None:
    """No per-tier counter read."""
    return None


@dataclass
class Canary:
    """Sends canary requests to one engine and keeps every call for the answer."""

    session: aiohttp.ClientSession
    base_url: str
    kind: str
    timeout_s: float
    count: Callable[[CanaryOutcome], None] = lambda _outcome: None
    api_key: str | None = field(default=None, repr=False)  # the engine's own key (upstream_api_key)
    model: str | None = None
    block_size: int | None = None
    user: str = field(default_factory=lambda: "cachewitness-canary-" + secrets.token_hex(8))
    calls: list[EngineCall] = field(default_factory=list)
    failure: str = ""  # what went wrong with the last failed canary request
    # What the canary's answered requests added to the engine's counters (the counter witness's `canary`).
    spent: Sums = field(default_factory=Sums)
    # The engine's cached tokens per tier (proxy/witnesses/tiers.py), read around the probes.
    read_tiers: Callable[[], Awaitable[Mapping[str, int] | None]] = field(default=_no_tiers, repr=False)
    # A multi-rank engine: the data-parallel rank every request of this canary is routed to.
    rank: int | None = None
    # What the engine's tokens cost per word, learned at earlier resets (one per sidecar).
    fit: CanaryFit = field(default_factory=CanaryFit)
    # The last answer's cached tokens per tier, where the engine named them (SGLang's sglext).
    last_tiers: Mapping[str, int] | None = None

    @property
    def n_tokens(self) -> int:
        """The canary's words' length in the engine's tokens: two of its cache blocks where it says, else the default."""
        return 2 * self.block_size if self.block_size else DEFAULT_CANARY_TOKENS

    async def sized(self, name: str, first_letters: str) -> Sized:
        """Fresh words that just reach `n_tokens`, counted on the engine's tokenizer route where it has one."""

        async def count(text: str) -> int | None:
            return await self.count_tokens(name, text)

        return await fit_words(self.n_tokens, first_letters, count, self.fit)

    async def count_tokens(self, name: str, text: str) -> int | None:
        """The engine's token count of `text` (its tokenizer route), None when it has no such route."""
        request = None if self.fit.tokenizer is False else tokenize_request(self.kind, self.model, text)
        if request is None:
            return None
        path, body = request
        reply = await engine_call(
            self.session,
            "POST",
            f"{self.base_url}{path}",
            timeout_s=self.timeout_s,
            headers={"Content-Type": "application/json", **(bearer(self.api_key) or {})},
            body=orjson.dumps(body),
        )
        ok = reply.status is not None and 200 <= reply.status < 300
        tokens = count_in_answer(self.kind, reply.json()) if ok else None
        if tokens is not None and tokens <= 0:
            tokens = None  # no count of words that are there
        if tokens is not None:
            self.fit.tokenizer = True
        elif reply.status in (404, 405):
            self.fit.tokenizer = False  # no such route (an older SGLang): ask no more, the usage tells
        # Never the words or their token ids: the excerpt holds the count only.
        excerpt = orjson.dumps({"tokenize": name, "tokens": tokens}).decode()
        self.calls.append(replace(reply.call, body_excerpt=excerpt))
        return tokens

    async def prepare(self) -> str | None:
        """Learn the model (and vLLM's block size); a reason when the canary cannot run."""
        models = await fetch_model_ids(self.session, self.base_url, self.timeout_s, self.api_key)
        if not models:
            return "the engine lists no model at /v1/models, so no canary could be sent"
        self.model = models[0]
        self.fit.serving(self.kind, self.model)
        self.block_size = await engine_block_size(
            self.session, self.base_url, self.kind, self.timeout_s, self.api_key
        )
        return None

    async def ask(self, name: str, prompt: str) -> Reading | None:
        """One canary request (max_tokens 1, temperature 0); its reading, None when it failed."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
            "n": 1,  # vLLM counts n x the prompt in its counters (vllm #56923): one choice only
        }
        if self.kind == EngineKind.SGLANG:
            body["return_cached_tokens_details"] = True  # per-tier hits in `sglext` (sglang #17648)
        if self.kind == EngineKind.MINDNANO:
            body["user"] = self.user  # mindnano caches per user
        headers = {"Content-Type": "application/json", **(bearer(self.api_key) or {})}
        if self.rank is not None:
            # The engines' DP routing hints: vLLM's header (SGLang reads it too), SGLang's body fields.
            headers[RANK_HEADER] = str(self.rank)
            if self.kind == EngineKind.SGLANG:
                body["routed_dp_rank"] = body["data_parallel_rank"] = self.rank
        # No `id_slot` on llama.cpp, though C2 "on C1's slot" was the plan: a pinned request
        # skips the host-RAM prompt cache both ways (llama-server 7e4c0a9, skulk wheel 0.10434.0:
        # pinned, C1 never reached the RAM cache; unpinned, C1 was cached there and its probe hit).
        reply = await engine_call(
            self.session,
            "POST",
            f"{self.base_url}/v1/chat/completions",
            timeout_s=self.timeout_s,
            headers=headers,
            body=orjson.dumps(body),
        )
        reading = None
        if reply.status is not None and 200 <= reply.status < 300:
            usage = usage_from_json(reply.body)
            reading = Reading(usage.cached_tokens, usage.prompt_tokens)
            self.last_tiers = usage.cached_by_tier
            self.spent = self.spent.plus(usage.prompt_tokens, usage.cached_tokens)
        else:
            self.failure = reply.call.error or f"HTTP {reply.status}"
            self.last_tiers = None
        self.count(_outcome(reading))
        # Never the prompt or the completion: the excerpt holds the numbers only.
        excerpt = orjson.dumps({"canary": name, **(reading.to_json() if reading else {})}).decode()
        self.calls.append(replace(reply.call, body_excerpt=excerpt))
        return reading

    def take_calls(self) -> list[EngineCall]:
        """The calls made since the last take, in order."""
        taken, self.calls = self.calls, []
        return taken


def _outcome(reading: Reading | None) -> CanaryOutcome:
    """The metric label of one canary request."""
    if reading is None:
        return CanaryOutcome.FAILED
    return CanaryOutcome.OK if reading.cached is not None else CanaryOutcome.UNREPORTED


ResetCall = Callable[[], Awaitable[CacheReset]]


async def verify_reset(canary: Canary, reset: ResetCall) -> tuple[CacheReset, Verification]:
    """Canary, reset, probes, resets; the main reset (every call listed) and what the canary proved."""
    started = time.monotonic()
    engine_reset, verification = await _run(canary, reset)
    return engine_reset, replace(verification, elapsed_s=time.monotonic() - started)


async def _run(canary: Canary, reset: ResetCall) -> tuple[CacheReset, Verification]:
    """The canary's steps; the engine reset always runs, whatever the canary found before it."""
    problem = await canary.prepare()
    if problem is not None:
        return await _reset_unprobed(canary, reset, problem)
    c1, first = await _first_canary(canary)
    if first is None:
        return await _reset_unprobed(canary, reset, f"the canary request failed ({canary.failure})")
    if first.cached is None:
        return await _reset_unprobed(canary, reset, _unreported_reason(canary.kind))
    c2 = (await canary.sized("C2", _C2_LETTERS)).text
    repeat = await canary.ask("C1 again", c1)
    if repeat is None or not repeat.cached:
        why = (
            f"the canary's repeat failed ({canary.failure})"
            if repeat is None
            else f"the canary's repeat was not cached ({repeat.quoted()} prompt tokens): the engine "
            "caches no prompt here (prefix caching off, or the canary is shorter than a cache block)"
        )
        return await _reset_unprobed(canary, reset, why, repeat)
    if await canary.ask("C2", c2) is None:
        return await _reset_unprobed(canary, reset, f"the second canary failed ({canary.failure})", repeat)
    main = await reset()
    before_calls = canary.take_calls()
    if not main.succeeded:
        reason = "the engine did not accept the reset, so the canary was not probed"
        return _with_calls(main, before_calls, []), _unverified(reason, repeat)
    tiers_before = await canary.read_tiers()
    probes = [await canary.ask("C1 probe", c1)]
    named = [canary.last_tiers]
    between = await reset()  # each probe meets a cache a reset just emptied
    probes.append(await canary.ask("C2 probe", c2))
    named.append(canary.last_tiers)
    final = await reset()  # nothing of the canaries is left for the benchmark's first request
    # The engine's counters per tier, else what the probes' own answers named (SGLang's sglext).
    by_tier = tier_delta(tiers_before, await canary.read_tiers()) or tier_sum(named)
    after_calls = canary.take_calls()
    # Order of the calls as they were made: probe, reset, probe, reset.
    after_calls[1:1] = between.calls
    after_calls.extend(final.calls)
    verification = replace(_judge(canary, repeat, probes, (between, final)), cached_by_tier=by_tier)
    return _with_calls(main, before_calls, after_calls), verification


async def _first_canary(canary: Canary) -> tuple[str, Reading | None]:
    """C1 sized and sent; sent again at the target's length when its usage shows it far off (no tokenizer)."""
    c1 = await canary.sized("C1", _C1_LETTERS)
    first = await canary.ask("C1", c1.text)
    if first is None or first.prompt is None:
        return c1.text, first
    again = resized(c1, first.prompt, canary.n_tokens, _C1_LETTERS, canary.fit)
    if again is None:
        return c1.text, first
    second = await canary.ask("C1 resized", again.text)
    if second is not None and second.prompt is not None:
        learn_template(c1, first.prompt, again, second.prompt, canary.fit)
    return again.text, second


async def _reset_unprobed(
    canary: Canary, reset: ResetCall, reason: str, before: Reading | None = None
) -> tuple[CacheReset, Verification]:
    """Reset without probing: the canary could not prove anything either way."""
    done = await reset()
    return _with_calls(done, canary.take_calls(), []), _unverified(reason, before)


def _judge(
    canary: Canary, before: Reading, probes: list[Reading | None], follow_ups: tuple[CacheReset, ...]
) -> Verification:
    """verified, contradicted or unverified from the probes, quoting the engine's numbers."""
    readings = tuple(probe for probe in probes if probe is not None)
    if len(readings) < len(probes):
        return _unverified(f"a canary probe after the reset failed ({canary.failure})", before, readings)
    if any(reading.cached is None for reading in readings):
        return _unverified("a canary probe after the reset had no cached-token count", before, readings)
    cached_before = f"a canary cached before the reset ({before.quoted()} prompt tokens)"
    hot = [reading for reading in readings if reading.cached]
    if hot:
        reason = f"{cached_before} was still cached after it ({hot[0].quoted()})"
        hint = _CONTRADICTED_HINTS.get(canary.kind, _DEFAULT_HINT)
        return _proved(Verified.CONTRADICTED, reason, before, readings, hint)
    refused = [done for done in follow_ups if not done.succeeded]
    if refused:
        reason = (
            f"{cached_before} ran cold after it, but a reset after the probes was not accepted "
            f"({refused[0].error or refused[0].outcome}): canary prompts may still be cached"
        )
        return _unverified(reason, before, readings)
    after = " and ".join(reading.quoted() for reading in readings)
    return _proved(Verified.VERIFIED, f"{cached_before} ran cold after it ({after})", before, readings)


def _proved(
    verified: Verified, reason: str, before: Reading, after: tuple[Reading, ...], hint: str | None = None
) -> Verification:
    """A canary that proved the reset (verified) or disproved it (contradicted)."""
    return Verification(VerifyMode.CANARY, verified, reason, before.prompt, before, after, hint=hint)


def _unverified(reason: str, before: Reading | None = None, after: tuple[Reading, ...] = ()) -> Verification:
    """A canary that ran and could not prove the reset either way."""
    canary_tokens = before.prompt if before is not None else None
    return Verification(VerifyMode.CANARY, Verified.UNVERIFIED, reason, canary_tokens, before, after)


def _unreported_reason(kind: str) -> str:
    """Why a canary without a cached-token field proves nothing, and how to switch the field on."""
    fix = _REPORT_FLAGS.get(kind, "switch on the engine's cached-token reporting")
    return f"the engine reports no cached-token count in its answers: {fix}"


def _with_calls(done: CacheReset, before: list[EngineCall], after: list[EngineCall]) -> CacheReset:
    """The reset with the canary's calls listed around its own, in the order they were made."""
    return replace(done, calls=(*before, *done.calls, *after))
