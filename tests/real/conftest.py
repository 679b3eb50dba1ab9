"""Fixtures for tests against real engines: tiny models, engines and sidecars as subprocesses.

Engines are expensive (vLLM takes about a minute to start on 2 cores), so the
main ones are session-scoped and shared; tests tag their requests with their own
session/case ids and find their own evidence records. Each sidecar writes its
evidence into its own directory.

Without the engines installed (scripts/setup-real-engines.sh) these tests skip,
except in CI (CI=true) or with CACHEWITNESS_REAL_REQUIRED=1, where they fail.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.real import engines, tiny_models
from tests.real.dynamo_engine import dynamo_python, start_dynamo
from tests.real.engines import ManagedProcess


@dataclass(frozen=True)
class Pair:
    """An engine and the sidecar in front of it."""

    engine: ManagedProcess
    sidecar: ManagedProcess
    evidence: Path

    @property
    def url(self) -> str:
        """The sidecar's base URL (what clients use)."""
        return self.sidecar.base_url

    @property
    def engine_url(self) -> str:
        """The engine's own base URL (for looking behind the sidecar)."""
        return self.engine.base_url


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/real with `real` (select with -m real, drop with -m 'not real').

    Their bound is raised from the suite's 120 s: the first test of an engine pays for its start
    (vLLM: about a minute on 2 cores, several when the machine is shared).
    """
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.real)
            item.add_marker(pytest.mark.timeout(900))


def _require(path: Path, what: str) -> None:
    """Skip (or fail in CI) when the setup script has not installed `what`."""
    if path.exists():
        return
    message = f"{what} is not installed ({path} missing): run scripts/setup-real-engines.sh"
    if os.environ.get("CI") == "true" or os.environ.get("CACHEWITNESS_REAL_REQUIRED") == "1":
        pytest.fail(message)
    pytest.skip(message)


def _start_pair(engine: ManagedProcess, name: str) -> Pair:
    """Start a sidecar before `engine` with evidence in a fresh directory."""
    evidence_dir = Path(tempfile.mkdtemp(prefix=f"cw-real-{name}-", dir=engines.logs_dir()))
    evidence = evidence_dir / "ev.jsonl"
    try:
        sidecar = engines.start_sidecar(engine.base_url, evidence)
    except BaseException:
        engines.stop(engine)
        raise
    return Pair(engine, sidecar, evidence)


def _stop_pair(pair: Pair) -> None:
    """Stop the sidecar first (it may flush evidence), then the engine."""
    engines.stop(pair.sidecar)
    engines.stop(pair.engine)


@pytest.fixture(scope="session")
def tiny_gguf() -> Path:
    """The tiny GGUF (generated once, cached under <cache>/models)."""
    _require(engines.llama_python(), "the gguf venv")
    return tiny_models.tiny_gguf()


@pytest.fixture(scope="session")
def tiny_hf() -> Path:
    """The tiny HF Llama folder (generated once, cached under <cache>/models)."""
    _require(engines.vllm_python(), "vLLM")
    return tiny_models.tiny_hf()


def _llama_pair(
    model: Path, name: str, *, slot_save: bool, cache_ram_mib: int | None, kv_unified: bool = False
) -> Pair:
    """Start llama-server with the given reset-relevant flags, and a sidecar before it."""
    _require(engines.llama_server_bin(), "llama-server")
    slot_dir = Path(tempfile.mkdtemp(prefix="cw-slots-", dir=engines.logs_dir())) if slot_save else None
    engine = engines.start_llama_server(
        model, slot_save_path=slot_dir, cache_ram_mib=cache_ram_mib, kv_unified=kv_unified
    )
    return _start_pair(engine, name)


@pytest.fixture(scope="session")
def llama(tiny_gguf: Path) -> Iterator[Pair]:
    """llama-server with `--slot-save-path` and `--cache-ram 0` (erase gives a cold cache), behind a sidecar."""
    pair = _llama_pair(tiny_gguf, "llama", slot_save=True, cache_ram_mib=0)
    yield pair
    _stop_pair(pair)


@pytest.fixture(scope="module")
def llama_ram_cache(tiny_gguf: Path) -> Iterator[Pair]:
    """llama-server with its default host-RAM prompt cache (erase leaves a copy), behind a sidecar."""
    pair = _llama_pair(tiny_gguf, "llama-ramcache", slot_save=True, cache_ram_mib=None, kv_unified=True)
    yield pair
    _stop_pair(pair)


@pytest.fixture(scope="module")
def llama_without_slot_save(tiny_gguf: Path) -> Iterator[Pair]:
    """llama-server without `--slot-save-path` (no slot actions at all), behind a sidecar."""
    pair = _llama_pair(tiny_gguf, "llama-noslots", slot_save=False, cache_ram_mib=0)
    yield pair
    _stop_pair(pair)


@pytest.fixture(scope="session")
def vllm(tiny_hf: Path) -> Iterator[Pair]:
    """vLLM with VLLM_SERVER_DEV_MODE=1, prefix caching and cached-token details, behind a sidecar."""
    pair = _start_pair(engines.start_vllm(tiny_hf, dev_mode=True), "vllm")
    yield pair
    _stop_pair(pair)


@pytest.fixture(scope="module")
def vllm_without_dev_mode(tiny_hf: Path) -> Iterator[Pair]:
    """A short-lived vLLM without dev mode (no /reset_prefix_cache), behind a sidecar."""
    pair = _start_pair(engines.start_vllm(tiny_hf, dev_mode=False), "vllm-nodev")
    yield pair
    _stop_pair(pair)


@pytest.fixture(params=["llama", "vllm"])
def any_engine(request: pytest.FixtureRequest) -> Pair:
    """Each main engine in turn (llama-server, then vLLM)."""
    pair: Pair = request.getfixturevalue(request.param)
    return pair


@pytest.fixture(scope="module")
def dynamo() -> Iterator[Pair]:
    """Dynamo's frontend and mocker, and a sidecar before the frontend (`--engine auto`)."""
    _require(dynamo_python(), "Dynamo")
    started = start_dynamo(tiny_models.tiny_tokenizer())
    evidence = Path(tempfile.mkdtemp(prefix="cw-real-dynamo-", dir=engines.logs_dir())) / "ev.jsonl"
    try:
        sidecar = engines.start_sidecar(started.frontend.base_url, evidence)
    except BaseException:
        started.stop()
        raise
    yield Pair(started.frontend, sidecar, evidence)
    engines.stop(sidecar)
    started.stop()
