"""A benchmark-like session for the report tests: resets and tagged requests through real sidecars.

Two sidecars write evidence for the same session: one in front of a vLLM simulator (its
resets verified) and one in front of a llama.cpp simulator that keeps its RAM prompt cache
(its reset contradicted). A request of another session goes through too, for the report to
leave out. The simulators prefill at a finite rate, so cold requests take longer than warm ones.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from proxy.sim import SimConfig
from tests.support.evidence_files import evidence_records, resets_file
from tests.support.sidecar import stack
from tests.support.sim import WAIT_S, chat, words

SESSION = "bench-1"
OTHER_SESSION = "other-bench"
PREFILL_RATE = 5000  # tokens/s: a 400-token cold prefill takes 80 ms, a warm one almost nothing


@dataclass(frozen=True)
class SessionRun:
    """Where the session's evidence is: the vLLM sidecar's URL (while it runs) and every file."""

    url: str
    files: tuple[Path, ...]
    http: aiohttp.ClientSession


async def _request(http: aiohttp.ClientSession, url: str, session: str, case: str, prompt: str) -> None:
    """One tagged chat completion through a sidecar."""
    headers = {"X-Session-Id": session, "X-Case-Id": case}
    body = chat(prompt, 2)
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        await response.read()


async def _reset(http: aiohttp.ClientSession, url: str, case: str) -> dict[str, Any]:
    async with http.post(f"{url}/cache/reset", json={"session_id": SESSION, "case_id": case}) as response:
        answer: dict[str, Any] = await response.json()
        return answer


async def _case(http: aiohttp.ClientSession, url: str, case: str, requests: int) -> dict[str, Any]:
    """A reset for the case, then `requests` requests of one prompt (the first cold, the rest warm)."""
    answer = await _reset(http, url, case)
    prompt = words(400, case.replace("-", ""))
    for _ in range(requests):
        await _request(http, url, SESSION, case, prompt)
    return answer


async def wait_records(evidence: Path, **counts: int) -> list[dict[str, Any]]:
    """The evidence on disk once it holds `counts` records of each kind (`cache_observation=6`), bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        records = evidence_records(evidence)
        seen = {kind: sum(1 for r in records if r["event_type"] == f"infer.{kind}") for kind in counts}
        if all(seen[kind] >= count for kind, count in counts.items()):
            return records
        if loop.time() > deadline:
            raise AssertionError(f"written to {evidence}: {seen}, waited for {counts}")
        await asyncio.sleep(0.02)


@asynccontextmanager
async def session_run(tmp_path: Path) -> AsyncIterator[SessionRun]:
    """Run the session; yield while the vLLM sidecar still serves, with every evidence file written."""
    vllm = SimConfig(dialect="vllm", decode_rate=0, prefill_rate=PREFILL_RATE)
    llama = SimConfig(
        dialect="llamacpp", decode_rate=0, prefill_rate=PREFILL_RATE, slot_save_path=".", ram_cache=True
    )
    llama_dir, vllm_dir = tmp_path / "llama", tmp_path / "vllm"
    async with stack(llama, llama_dir) as s:
        contradicted = await _case(s.http, s.url, "ram-cache", 2)
        assert contradicted["answer"] == "contradicted", contradicted
    llama_evidence = llama_dir / "evidence" / "cachewitness.jsonl"
    async with stack(vllm, vllm_dir) as s:
        for case, requests in (("cold-1", 3), ("cold-2", 2)):
            answer = await _case(s.http, s.url, case, requests)
            assert answer["verified"] == "verified", answer
        await _request(s.http, s.url, OTHER_SESSION, "x", words(50))
        evidence = vllm_dir / "evidence" / "cachewitness.jsonl"
        await wait_records(evidence, cache_observation=6, cache_verification=2)
        files = (llama_evidence, resets_file(llama_evidence), evidence, resets_file(evidence))
        yield SessionRun(s.url, files, s.http)


def session_records(files: tuple[Path, ...]) -> list[dict[str, Any]]:
    """Every record of the files, read here the plain way (independent of the report's reader)."""
    records: list[dict[str, Any]] = []
    for path in files:
        records += [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return records


def expected_rows(records: list[dict[str, Any]], session: str) -> dict[str, list[str]]:
    """Each case's table row as the evidence says it, computed here from the raw records."""
    rows: dict[str, dict[str, Any]] = {}
    for record in records:
        if record.get("session_id") != session:
            continue
        row = rows.setdefault(
            record["case_id"],
            {
                "answer": "-",
                "verified": "-",
                "verdict": "-",
                "witnesses": "-",
                "bypass": "-",  # no infer.cache_reconciliation: the engine's counters were not read
                "n": 0,
                "prompt": 0,
                "cached": 0,
                "ttft_ms": [],
                "added_us": [],
            },
        )
        kind = record["event_type"]
        if kind == "infer.cache_state":
            row["answer"] = record["reset"]["answer"]
            row["verified"] = record["verified"]
            named = record["verification"].get("witnesses") or {}
            row["witnesses"] = (
                ", ".join(f"{name} {said['result']}" for name, said in named.items())
                if named
                else f"{record['verification']['method']} {record['verified']}"
            )
            if row["verdict"] == "-":
                row["verdict"] = "pending"
        elif kind == "infer.cache_verification":
            row["verdict"] = record["verdict"]
        elif kind == "infer.cache_reconciliation":
            bypass = record["bypass"]
            row["bypass"] = (
                f"{bypass['requests']} requests, {bypass['cached_tokens']} cached tokens"
                if bypass
                else "unknown"
            )
        elif kind == "infer.cache_observation":
            row["n"] += 1
            row["prompt"] += record["prompt_tokens"]
            row["cached"] += record["cached_tokens"]
            row["ttft_ms"].append((record["first_byte_ns"] - record["started_ns"]) / 1e6)
            overhead = record["overhead"]
            row["added_us"].append(overhead["added_in_us"] + overhead["added_out_us"])
    return {
        case: [
            case,
            r["answer"],
            r["verified"],
            r["verdict"],
            r["witnesses"],
            str(r["n"]),
            str(r["prompt"]),
            str(r["cached"]),
            f"{100 * r['cached'] / r['prompt']:.1f}%" if r["prompt"] else "n/a",
            r["bypass"],
            f"{_rank(r['ttft_ms'], 0.5):.1f} ms" if r["ttft_ms"] else "-",
            f"{_rank(r['added_us'], 0.5)} / {_rank(r['added_us'], 0.99)} µs" if r["added_us"] else "-",
        ]
        for case, r in rows.items()
    }


def _rank(values: list[Any], q: float) -> Any:
    """The nearest-rank quantile: the ceil(q·n)-th smallest value."""
    ordered = sorted(values)
    return ordered[math.ceil(q * len(ordered)) - 1]


def hostile_evidence(path: Path) -> Path:
    """An evidence file whose ids are markup: what the sidecar never writes, but a file may hold."""
    case = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    records = [
        {
            "event_type": "infer.cache_state",
            "session_id": "s<b>1</b>",
            "case_id": case,
            "at_ns": 1_000_000_000,
            "reset": {"answer": "acknowledged"},
            "verified": "verified",
            "verification": {"method": "canary"},
        },
        {
            "event_type": "infer.cache_observation",
            "session_id": "s<b>1</b>",
            "case_id": case,
            "started_ns": 1_100_000_000,
            "first_byte_ns": 1_150_000_000,
            "prompt_tokens": 10,
            "cached_tokens": 0,
        },
    ]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records) + b"not json\n")
    return path
