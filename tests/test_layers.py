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
    frozenset({"config"}),
    frozenset({"observe", "engines", "upstream", "sim"}),
    frozenset(
        {
            "evidence",
            "metrics",
            "witnesses",
            "admission",
            "body_budget",
            "connections",
            "engine_state",
            "health",
            "refusals",
        }
    ),
    frozenset({"recorder"}),
    frozenset({"forward", "reset"}),
    frozenset({"cluster"}),
    frozenset({"admin"}),
    frozenset({"app", "probe_listener"}),
    frozenset({"serve"}),
    frozenset({"cli"}),
    frozenset({"__main__"}),
)
RANK = {unit: rank for rank, layer in enumerate(LAYERS) for unit in layer}

# Known imports against the order, each to be removed by inverting it (issue 28, phase 2).
# (importer module, imported module): why it is there today -> the fix.
ALLOWED_UPWARD: frozenset[tuple[str, str]] = frozenset(
    {
        # A CLI module read by the server: CLUSTER_READ_EVENT -> vocabulary.EventType.
        ("proxy.cluster.evidence", "proxy.cli.cluster_report"),
        # ENGINE_KINDS from EngineKind -> vocabulary.EngineKind.
        ("proxy.config", "proxy.engines.base"),
        # VERIFY_MODES from VerifyMode -> vocabulary.VerifyMode.
        ("proxy.config", "proxy.witnesses.verification"),
        # engine_call sends through send_upstream (sideways): put upstream in the layer below
        # observe/engines (it imports only logs, watchdog, config), or hand engine_call a send.
        ("proxy.engines.base", "proxy.upstream.resend"),
        # The probe path of the detected dialect (sideways): build_app hands setup_health a
        # reader of the engine state, or health moves a layer up.
        ("proxy.health", "proxy.engine_state"),
        # Label sets from Verified, CanaryOutcome and Verdict -> vocabulary.
        ("proxy.metrics.families", "proxy.witnesses.verification"),
        ("proxy.metrics.labels", "proxy.witnesses.traffic"),
        ("proxy.metrics.labels", "proxy.witnesses.verification"),
        # metrics reads six services at scrape time (sideways): each service gets a reader
        # function of its own state, and build_app hands the readers to setup_metrics.
        ("proxy.metrics.state", "proxy.admission"),
        ("proxy.metrics.state", "proxy.body_budget"),
        ("proxy.metrics.state", "proxy.connections"),
        ("proxy.metrics.state", "proxy.engine_state"),
        ("proxy.metrics.state", "proxy.evidence.log"),
        ("proxy.metrics.state", "proxy.refusals"),
        # The detected engine's resets pre-created at scrape time -> a reader from build_app.
        ("proxy.metrics", "proxy.engine_state"),
        ("proxy.metrics.state", "proxy.health"),
        # rules_for(EngineInfo), EngineKind (sideways) -> vocabulary.EngineKind, and
        # rules_for(kind, version) takes the two values.
        ("proxy.observe.rules", "proxy.engines.base"),
        # scope=cluster dispatch inside the reset handler -> the handler moves to admin/views,
        # which may import both reset and cluster.
        ("proxy.reset.service", "proxy.cluster.fanout"),
        # The canary reads the engine's /metrics and /v1/models (sideways) -> engines/queries.
        ("proxy.witnesses.canary", "proxy.metrics.merge"),
        ("proxy.witnesses.canary", "proxy.metrics.models"),
    }
)

# Known module circles (each a set of modules), to be broken in phase 2.
ALLOWED_CIRCLES: frozenset[frozenset[str]] = frozenset(
    {
        # Type-checking only: the answer names its Connection, the connection its pool.
        # -> a Protocol each in answer.py (what it calls on its connection: taken, abandon) and
        # connection.py (what it calls on its pool: forget, release, watch).
        frozenset({"proxy.upstream.answer", "proxy.upstream.connection", "proxy.upstream.leg"}),
    }
)


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
