"""The import graph's shape: the engine's modules import one another without a cycle at module
level (type-only imports included, since a cycle there still ties the modules' meanings
together). An import inside a function is a deliberate late binding and not counted: the
model registry's entry points (engine.models.config, .weights) call into the registry that
imports the families, which import them.

The frontend's wings (frontend/README.md) import only downward, and `shared/` imports no tier
(late imports included in both).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, package: str, known: set[str], everywhere: bool = False) -> set[str]:
    """The modules of `package` that the file at `path` imports, by absolute name: at module
    level, or `everywhere` (function bodies too)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if everywhere else module_level(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known and name.startswith(package)}
    return found


def module_level(tree: ast.Module):
    """Every node outside function bodies (a class's body and `if TYPE_CHECKING:` included)."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        pending.extend(ast.iter_child_nodes(node))


def import_graph(package: str, everywhere: bool = False) -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    known = set(files)
    return {name: imports_of(path, package, known, everywhere) - {name}
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
        for nxt in graph.get(node, ()):
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


def test_the_engine_has_no_import_cycle():
    assert cycles(import_graph("engine")) == []


# The frontend's wings from the top down (frontend/README.md); wings of one rank are siblings
# and import neither each other nor anything above them.
FRONTEND_WINGS = {
    "http": 5,
    "openai": 4, "responses": 4, "anthropic": 4, "pooling": 4, "batches": 4,
    "core": 3,
    "input": 2, "engines": 2, "state": 2,
    "base": 1,
}


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "frontend" else None


def upward_imports(graph: dict[str, set[str]], ranks: dict[str, int]) -> list[str]:
    """`a -> b` for every import from a wing into one above it or a sibling beside it."""
    wrong = []
    for module, imported in sorted(graph.items()):
        here = wing_of(module)
        for target in sorted(imported):
            there = wing_of(target)
            if here is None or there is None or here == there:
                continue
            if ranks[there] >= ranks[here]:
                wrong.append(f"{module} -> {target}")
    return wrong


def test_every_frontend_module_sits_in_a_wing():
    """A new flat file in frontend/ has no layer: put it in the wing it belongs to."""
    outside = [m for m in import_graph("frontend")
               if m != "frontend" and m.split(".")[1] not in FRONTEND_WINGS]
    assert outside == []


def test_the_wing_check_finds_an_upward_and_a_sideways_import():
    graph = {"frontend.base.errors": {"frontend.anthropic.models"},
             "frontend.input.tokenization": {"frontend.engines.tracking"},
             "frontend.http.app": {"frontend.core.pipeline"}}
    assert upward_imports(graph, FRONTEND_WINGS) == [
        "frontend.base.errors -> frontend.anthropic.models",
        "frontend.input.tokenization -> frontend.engines.tracking"]


def test_frontend_imports_run_down_its_wings():
    # A late import inside a function counts here: it ties the layers together all the same.
    assert upward_imports(import_graph("frontend", everywhere=True), FRONTEND_WINGS) == []


def tier_imports(folder: Path, tiers: tuple[str, ...]) -> list[str]:
    """`file -> module` for every import of a tier under `folder`, late ones included."""
    wrong = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            wrong += [f"{path.relative_to(folder.parent)} -> {name}" for name in names
                      if name.split(".")[0] in tiers]
    return wrong


def test_shared_imports_no_tier():
    # The tiers give their commands to the console script (sluice/cli.py) instead.
    assert tier_imports(ROOT / "shared", ("frontend", "engine", "postproc", "sluice")) == []


def test_the_tier_check_finds_a_late_import(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("import os\n\n\ndef f():\n    from engine import x\n")
    assert tier_imports(tmp_path / "pkg", ("engine",)) == ["pkg/a.py -> engine"]
