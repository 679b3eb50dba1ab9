"""Make the tiny test models once and keep them under <cache>/models, keyed by the generator's hash."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from tests.real.dynamo_engine import dynamo_python
from tests.real.engines import cache_root, llama_python, logs_dir, vllm_python

HERE = Path(__file__).resolve().parent
GENERATE_TIMEOUT_S = 300.0


def _generator_key(script: Path) -> str:
    """The first 12 hex digits of the generator's SHA-256: a changed generator makes a new model."""
    return hashlib.sha256(script.read_bytes()).hexdigest()[:12]


def _generate(python: Path, script: Path, out: Path) -> Path:
    """Run `script` with `python` to write `out` unless it is already there."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log = logs_dir() / f"{out.name}.log"
    with log.open("wb") as sink:
        done = subprocess.run(
            [str(python), str(script), str(out)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=GENERATE_TIMEOUT_S,
            check=False,
        )
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"{script.name} failed ({done.returncode}); see {log}")
    return out


def tiny_gguf() -> Path:
    """The tiny llama GGUF for llama-server (printable ASCII output, never EOS)."""
    script = HERE / "make_tiny_gguf.py"
    out = cache_root() / "models" / f"tiny-{_generator_key(script)}.gguf"
    return _generate(llama_python(), script, out)


def tiny_tokenizer() -> Path:
    """A tokenizer-only model folder for Dynamo's mocker (it simulates the engine, no weights)."""
    script = HERE / "make_tiny_tokenizer.py"
    out = cache_root() / "models" / f"tiny-tokenizer-{_generator_key(script)}"
    return _generate(dynamo_python(), script, out)


def tiny_hf() -> Path:
    """The tiny HF Llama folder for vLLM (head_dim 64)."""
    script = HERE / "make_tiny_hf.py"
    out = cache_root() / "models" / f"tiny-hf-{_generator_key(script)}"
    return _generate(vllm_python(), script, out)
