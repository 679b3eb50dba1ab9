"""A bench script's module, for the tests of its pure parts (bench/ is scripts, not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

__all__ = ["bench_module"]

_BENCH = Path(__file__).resolve().parent.parent.parent / "bench"


def bench_module(name: str) -> Any:
    """bench/`name`.py, loaded as the bench loads it: one that imports its neighbours cannot be."""
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
