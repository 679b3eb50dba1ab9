"""The house's layering, checked: no import against the layer order, no module circle.

`proxy/`'s packages and top-level modules stand in layers (docs/architecture.md); each imports
only from lower layers or from inside its own package. Every import statement counts, the ones
under `if TYPE_CHECKING:` and inside functions too: a circle the type checker sees is a circle.
Each package and top-level module must also import alone in a fresh interpreter (as aiohttp's
tests/test_circular_imports.py does), which catches the circles that only bite at import time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROXY = ROOT / "proxy"

# Lowest first. A unit is a top-level module or package of proxy/ (`proxy.forward.relay`'s unit
# is `forward`); units in one layer do not import each other either.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"vocabulary", "logs", "errors", "redact", "watchdog"}),
    frozenset({"config"}),  # the settings, the option table and their loading
    # upstream (the pool and the leg) reads only config, logs and watchdog; the engines' own
    # calls go through it.
    frozenset({"upstream"}),
    frozenset({"observe", "engines", "sim"}),
    frozenset(
        {
            "evidence",
            "metrics",
            "witnesses",
            "admission",
            "body_budget",
            "engine_state",
            "health",
            "refusals",
        }
    ),
    frozenset({"recorder"}),
    frozenset({"forward", "reset"}),
    frozenset({"cluster"}),
    frozenset({"admin"}),
    frozenset({"inbound"}),  # the client connections: the front, aiohttp's side, the guard
    frozenset({"app", "probe_listener"}),
    frozenset({"serve"}),
    frozenset({"cli"}),
    frozenset({"__main__"}),
)
RANK = {unit: rank for rank, layer in enumerate(LAYERS) for unit in layer}

# Known imports against the order: none. An entry here would be (importer module, imported
# module) with a comment that says why it is there and how it is to go.
ALLOWED_UPWARD: frozenset[tuple[str, str]] = frozenset()

# Known module circles (each a set of modules): none.
ALLOWED_CIRCLES: frozenset[frozenset[str]] = frozenset()


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PROXY.rglob("*.py")) if "__pycache__" not in p.parts}


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """Every proxy module `name` imports, wherever the statement is (TYPE_CHECKING included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from proxy.a import b` imports the module proxy.a.b when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if target == "proxy" or not target.startswith("proxy."):
                continue  # the root package holds only __version__
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known:
                yield target


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imported(name, path, known)) - {name} for name, path in known.items()}


def unit(module: str) -> str:
    return module.split(".")[1]


def upward_imports() -> set[tuple[str, str]]:
    """Imports from a unit to one in its own layer or above (outside its own package)."""
    found = set()
    for importer, targets in graph().items():
        if importer == "proxy":
            continue
        for target in targets:
            here, there = unit(importer), unit(target)
            if here not in RANK or there not in RANK:
                continue  # test_every_unit_has_a_layer names it
            if here != there and RANK[there] >= RANK[here]:
                found.add((importer, target))
    return found


def circles() -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_unit_has_a_layer() -> None:
    units = {unit(name) for name in modules() if name != "proxy"}
    homeless = sorted(units - RANK.keys())
    assert not homeless, f"give each new module or package a layer in LAYERS: {homeless}"


def test_no_import_against_the_layers() -> None:
    found = upward_imports()
    against = sorted(found - ALLOWED_UPWARD)
    assert not against, f"imports from a layer to one not below it: {against}"
    gone = sorted(ALLOWED_UPWARD - found)
    assert not gone, f"gone: take these out of ALLOWED_UPWARD: {gone}"


def test_no_module_circle() -> None:
    found = circles()
    new = sorted(sorted(circle) for circle in found - ALLOWED_CIRCLES)
    assert not new, f"modules that import each other, round a circle: {new}"
    gone = sorted(sorted(circle) for circle in ALLOWED_CIRCLES - found)
    assert not gone, f"gone: take these out of ALLOWED_CIRCLES: {gone}"


def test_sim_imports_nothing_outside_itself() -> None:
    outside = {
        (importer, target)
        for importer, targets in graph().items()
        if importer != "proxy" and unit(importer) == "sim"
        for target in targets
        if unit(target) != "sim"
    }
    assert not outside, f"the simulator stands alone: {sorted(outside)}"


UNITS = sorted({".".join(name.split(".")[:2]) for name in modules() if name != "proxy"})


@pytest.mark.parametrize("name", [n for n in UNITS if n != "proxy.__main__"])
def test_imports_alone(name: str) -> None:
    """Imported first, in an interpreter of its own: a circle at import time fails here."""
    result = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", f"import {name}"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]


if __name__ == "__main__":
    # `python tests/test_layers.py`: this tree against the allow-lists, NEW where it breaks them.
    found_upward, found_circles = upward_imports(), circles()
    for importer, target in sorted(found_upward):
        mark = "allowed" if (importer, target) in ALLOWED_UPWARD else "NEW"
        print(f"upward {mark}: {importer} -> {target}")
    for importer, target in sorted(ALLOWED_UPWARD - found_upward):
        print(f"upward gone (take out of ALLOWED_UPWARD): {importer} -> {target}")
    for circle in sorted(found_circles, key=sorted):
        mark = "allowed" if circle in ALLOWED_CIRCLES else "NEW"
        print(f"circle {mark}: {sorted(circle)}")
    for circle in sorted(ALLOWED_CIRCLES - found_circles, key=sorted):
        print(f"circle gone (take out of ALLOWED_CIRCLES): {sorted(circle)}")
    homeless = sorted({unit(n) for n in modules() if n != "proxy"} - RANK.keys())
    for name in homeless:
        print(f"no layer: {name}")


def diagram_layers() -> list[frozenset[str]]:
    """The layer diagram of docs/architecture.md, lowest layer first: one `└` line per layer
    (a line without one continues the layer above it)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    layers: list[set[str]] = []
    for line in block.strip().splitlines():
        units = {unit.strip() for unit in line.replace("└", "").split("·") if unit.strip()}
        if "└" in line or not layers:
            layers.append(units)
        else:
            layers[-1] |= units
    return [frozenset(layer) for layer in reversed(layers)]


def test_the_documented_diagram_is_the_layer_table() -> None:
    assert diagram_layers() == [layer for layer in LAYERS if layer != {"__main__"}]
