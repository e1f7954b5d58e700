"""The import graph's shape, every import counted: at module level, inside a function, under
`if TYPE_CHECKING:` alike (a late import ties two modules' meanings together just as a top-level
one does, it only hides the knot from the interpreter).

- No package (engine/, frontend/, postproc/, shared/, sluice/) has an import cycle, nor does
  the repo as a whole.
- The tiers import only down: shared/ imports no tier; engine/ and postproc/ import shared/
  only; frontend/ imports shared/ and postproc/ (it runs output processing inline); sluice/
  (the console script) imports them all.
- Inside the frontend (frontend/README.md) the wings import only down.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "frontend", "postproc", "shared", "sluice")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name the file imports, wherever the import stands; `from a import b`
    gives both `a` and `a.b` (b may be a module), relative imports resolved."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def import_graph(packages=PACKAGES, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the repo's modules it imports."""
    files = {module_name(p, root): p for package in packages
             for p in (root / package).rglob("*.py")}
    known = set(files)
    return {name: (imported_names(path, name) & known) - {name} for name, path in files.items()}


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


GRAPH = import_graph()


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_kind_of_import_is_counted(tmp_path):
    """A late import, a type-only one and a relative one are edges like a top-level one."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import X\n")
    (pkg / "c.py").write_text("from . import a\n")
    graph = import_graph(("pkg",), tmp_path)
    assert graph["pkg.a"] == {"pkg", "pkg.b"}
    assert graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg", "pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_in(package):
    inside = {m: {t for t in targets if t.split(".")[0] == package}
              for m, targets in GRAPH.items() if m.split(".")[0] == package}
    assert cycles(inside) == []


def test_no_import_cycle_across_the_repo():
    assert cycles(GRAPH) == []


# --- tiers ------------------------------------------------------------------------------------

# What each tier may import besides itself.
TIER_IMPORTS = {
    "shared": set(),
    "engine": {"shared"},
    "postproc": {"shared"},
    "frontend": {"shared", "postproc"},
    "sluice": {"shared", "engine", "postproc", "frontend"},
}


def tier_imports(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for every import of a tier the importing tier may not import."""
    wrong = []
    for module, imported in sorted(graph.items()):
        here = module.split(".")[0]
        wrong += [f"{module} -> {target}" for target in sorted(imported)
                  if (there := target.split(".")[0]) != here
                  and there not in TIER_IMPORTS[here]]
    return wrong


def test_the_tier_check_finds_an_upward_and_a_sideways_import():
    graph = {"shared.codec": {"engine.core"}, "engine.core": {"postproc.chunks"},
             "frontend.http.app": {"postproc.chunks", "shared.codec"}}
    assert tier_imports(graph) == ["engine.core -> postproc.chunks",
                                   "shared.codec -> engine.core"]


def test_the_tiers_import_only_down():
    assert tier_imports(GRAPH) == []


# --- wings inside a tier ----------------------------------------------------------------------

# The frontend's wings from the top down (frontend/README.md); wings of one rank are siblings
# and import neither each other nor anything above them.
FRONTEND_WINGS = {
    "http": 5,
    "openai": 4, "responses": 4, "anthropic": 4, "pooling": 4, "batches": 4,
    "core": 3,
    "input": 2, "engines": 2, "state": 2,
    "base": 1,
}


def wing_of(module: str, tier: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == tier else None


def upward_imports(graph: dict[str, set[str]], tier: str, ranks: dict[str, int]) -> list[str]:
    """`a -> b` for every import from a wing of `tier` into one above it or a sibling beside
    it."""
    wrong = []
    for module, imported in sorted(graph.items()):
        here = wing_of(module, tier)
        for target in sorted(imported):
            there = wing_of(target, tier)
            if here is None or there is None or here == there:
                continue
            if ranks[there] >= ranks[here]:
                wrong.append(f"{module} -> {target}")
    return wrong


def modules_outside_wings(tier: str, ranks: dict[str, int]) -> list[str]:
    return [m for m in GRAPH if m.split(".")[0] == tier and m != tier
            and m.split(".")[1] not in ranks]


def test_every_frontend_module_sits_in_a_wing():
    """A new flat file in frontend/ has no layer: put it in the wing it belongs to."""
    assert modules_outside_wings("frontend", FRONTEND_WINGS) == []


def test_the_wing_check_finds_an_upward_and_a_sideways_import():
    graph = {"frontend.base.errors": {"frontend.anthropic.models"},
             "frontend.input.tokenization": {"frontend.engines.tracking"},
             "frontend.http.app": {"frontend.core.pipeline"}}
    assert upward_imports(graph, "frontend", FRONTEND_WINGS) == [
        "frontend.base.errors -> frontend.anthropic.models",
        "frontend.input.tokenization -> frontend.engines.tracking"]


def test_frontend_imports_run_down_its_wings():
    assert upward_imports(GRAPH, "frontend", FRONTEND_WINGS) == []
