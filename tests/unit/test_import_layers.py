"""The import graph's shape, with every import counted: at module level, inside a function,
under `if TYPE_CHECKING:`, absolute or relative. A late import ties two modules together all
the same, so none is a way around these rules.

- No package (engine/, frontend/, postproc/, shared/, sluice/) has an import cycle.
- The tiers import only downward (TIER_IMPORTS): `shared/` imports no tier, postproc neither
  frontend nor engine, the engine no other tier, and only the console script (`sluice/`)
  imports them all.
- frontend/'s wings (frontend/README.md) import only downward.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "frontend", "postproc", "shared", "sluice")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name an import statement anywhere in the file names, relative ones made
    absolute: `from a.b import c` names `a.b` and `a.b.c` (c may be a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports."""
    files = {module_name(p, root): p for package in packages
             for p in (root / package).rglob("*.py")}
    return {name: (imported_names(path, name) & set(files)) - {name}
            for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_kind_of_import_is_counted(tmp_path):
    """A late import, a type-only one and a relative one each close a cycle here."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import pkg.b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.d import D\n")
    (pkg / "d.py").write_text("from .c import x\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    graph = import_graph()
    inside = {m: {t for t in targets if t.split(".")[0] == package}
              for m, targets in graph.items() if m.split(".")[0] == package}
    assert cycles(inside) == []


# Which tiers each may import (besides itself). The frontend and the engine meet only in
# shared/protocol; the frontend runs postproc's parsers when no worker does.
TIER_IMPORTS = {
    "sluice": {"engine", "frontend", "postproc", "shared"},
    "frontend": {"postproc", "shared"},
    "engine": {"shared"},
    "postproc": {"shared"},
    "shared": set(),
}


def tier_violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} -> {target}" for module, targets in sorted(graph.items())
            for target in sorted(targets)
            if target.split(".")[0] != module.split(".")[0]
            and target.split(".")[0] not in TIER_IMPORTS[module.split(".")[0]]]


def test_the_tier_check_finds_a_late_import(tmp_path):
    for tier in ("shared", "engine"):
        (tmp_path / tier).mkdir()
        (tmp_path / tier / "__init__.py").write_text("")
    (tmp_path / "shared" / "a.py").write_text("import os\n\n\ndef f():\n    from engine import x\n")
    graph = import_graph(tmp_path, ("shared", "engine"))
    assert tier_violations(graph) == ["shared.a -> engine"]


def test_tiers_import_only_downward():
    assert tier_violations(import_graph()) == []


def wing_of(module: str, package: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == package else None


def upward_imports(graph: dict[str, set[str]], package: str, ranks: dict[str, int]) -> list[str]:
    """`a -> b` for every import from a wing of `package` into one above it or a sibling
    beside it."""
    wrong = []
    for module, imported in sorted(graph.items()):
        here = wing_of(module, package)
        for target in sorted(imported):
            there = wing_of(target, package)
            if here is None or there is None or here == there:
                continue
            if ranks[there] >= ranks[here]:
                wrong.append(f"{module} -> {target}")
    return wrong


# The frontend's wings from the top down (frontend/README.md); wings of one rank are siblings
# and import neither each other nor anything above them.
FRONTEND_WINGS = {
    "http": 5,
    "openai": 4, "responses": 4, "anthropic": 4, "embeddings": 4, "batches": 4, "web": 4,
    "pipeline": 3,
    "input": 2, "engine_client": 2, "state": 2,
    "base": 1,
}


def test_every_frontend_module_sits_in_a_wing():
    """A new flat file in frontend/ has no layer: put it in the wing it belongs to."""
    outside = [m for m in import_graph(packages=("frontend",))
               if m != "frontend" and m.split(".")[1] not in FRONTEND_WINGS]
    assert outside == []


def test_the_wing_check_finds_an_upward_and_a_sideways_import():
    graph = {"frontend.base.errors": {"frontend.anthropic.models"},
             "frontend.input.tokenization": {"frontend.engine_client.tracking"},
             "frontend.http.app": {"frontend.pipeline.pipeline"}}
    assert upward_imports(graph, "frontend", FRONTEND_WINGS) == [
        "frontend.base.errors -> frontend.anthropic.models",
        "frontend.input.tokenization -> frontend.engine_client.tracking"]


def test_frontend_imports_run_down_its_wings():
    assert upward_imports(import_graph(), "frontend", FRONTEND_WINGS) == []


# The engine's wings from the top down (engine/README.md), with the same rule.
ENGINE_WINGS = {
    "process": 7,
    "parallel": 6,
    "step": 5,
    "models": 4,
    "attention": 3,
    "layers": 2,
    "request": 1, "kernels": 1,
}


def test_every_engine_module_sits_in_a_wing():
    """A new flat file in engine/ has no layer: put it in the wing it belongs to."""
    outside = [m for m in import_graph(packages=("engine",))
               if m != "engine" and m.split(".")[1] not in ENGINE_WINGS]
    assert outside == []


def test_engine_imports_run_down_its_wings():
    assert upward_imports(import_graph(), "engine", ENGINE_WINGS) == []
