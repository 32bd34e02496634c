"""Layers point down: nothing below the monitors (``lightning_4d.callbacks``) or the recipes imports them — at
module level or inside a function — except the package's ``__init__`` that registers the monitors' hooks; and no
two modules of the package import each other, directly or around a loop (counting imports inside functions,
``TYPE_CHECKING`` imports, relative imports and the subpackage ``__init__`` an import runs first)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import lightning_4d

ROOT = Path(lightning_4d.__file__).parent
UPPER = ("lightning_4d.callbacks", "lightning_4d.recipes")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_lower_layers_do_not_import_the_monitors_or_recipes() -> None:
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        if module == "lightning_4d.__init__" or module.startswith(UPPER):
            continue
        for name in _imports(path):
            if name.startswith(UPPER):
                offenders.append(f"{module} imports {name}")
    assert not offenders, "\n".join(offenders)


# ---------------------------------------------------------------------------------------------- cycles
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in ROOT.rglob("*.py")}


def _owner(name: str) -> str:
    """The package module ``name`` is, or the one defining it (``lightning_4d.mesh.Axis`` -> ``lightning_4d.mesh``)."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def import_edges(module: str, source: Optional[str] = None) -> set[str]:
    """Every package module ``module`` imports (its file, or ``source``), anywhere in its code: ``from a.b import c``
    counts as an import of ``a.b.c`` when that is a module, else of ``a.b``; relative imports are resolved against
    ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, filename=str(path))):
        if isinstance(node, ast.Import):
            edges.update(_owner(a.name) for a in node.names if a.name.split(".")[0] == ROOT.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.split(".")[0] != ROOT.name:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                edges.add(full if full in MODULES else _owner(base))
    edges.update(_parent_packages(edges, module))
    edges.discard(module)
    return edges


def _parent_packages(edges: set[str], module: str) -> set[str]:
    """Importing ``lightning_4d.a.b`` first runs ``lightning_4d/a/__init__.py``: that package is imported too
    (not the root package, which every module imports, nor a package ``module`` itself lives in)."""
    parents = set()
    for edge in edges:
        parts = edge.split(".")
        for cut in range(2, len(parts)):
            package = ".".join(parts[:cut])
            if package in MODULES and not module.startswith(package + "."):
                parents.add(package)
    return parents


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:
        start = min(group)
        parents: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parents:  # breadth first, inside the group, back to start
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & group):
                    if w not in parents:
                        parents[w] = v
                        nxt.append(w)
            frontier = nxt
        path, v = [start], parents[start]
        while v != start:
            path.append(v)
            v = parents[v]
        cycles.append([start] + path[:0:-1] + [start] if len(path) > 1 else [start, start])
    return cycles


def test_the_cycle_finder_finds_a_loop_and_its_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_function_local_imports_are_edges() -> None:
    assert "lightning_4d.config" in import_edges("lightning_4d.strategy")
    relative = "from .mesh import Axis\nfrom . import config\nif TYPE_CHECKING:\n    from ..analysis.trace import ModelTrace\n"
    # inside lightning_4d.pipeline, ``.mesh`` and ``.config`` are no modules: the package itself is imported
    assert import_edges("lightning_4d.pipeline.runner", relative) == {
        "lightning_4d.pipeline", "lightning_4d.analysis.trace", "lightning_4d.analysis"}
    assert import_edges("lightning_4d.strategy", relative) == {"lightning_4d.mesh", "lightning_4d.config"}
    assert "lightning_4d.callbacks.summary" in import_edges("lightning_4d")  # the registering import
    assert "lightning_4d.analysis.discovery" in import_edges("lightning_4d.pipeline.stages")  # inside a function
    # importing a module inside a subpackage runs the subpackage's __init__ first
    assert "lightning_4d.models" in import_edges("lightning_4d.strategy", "from lightning_4d.models.hf import X\n")
    inside = import_edges("lightning_4d.pipeline.runner", "from lightning_4d.pipeline.stages import X\n")
    assert inside == {"lightning_4d.pipeline.stages"}  # its own package is already running


def test_no_import_cycles_between_modules() -> None:
    graph = {module: import_edges(module) for module in MODULES}
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (move what both sides need to the lowest module that needs it):\n" + "\n".join(
        " -> ".join(c) for c in cycles)


def _room(module: str) -> str:
    """The top-level module or subpackage ``module`` belongs to (``lightning_4d.layout.pipeline_glue`` -> ``pipeline``)."""
    return module.split(".")[1] if "." in module else ""


def test_no_import_cycles_between_rooms() -> None:
    """The rooms of ``docs/architecture.md`` (top-level modules and subpackages) form layers too: no subpackage
    reaches another that reaches back, even through different modules of each."""
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        if _room(module):
            graph.setdefault(_room(module), set()).update(
                _room(edge) for edge in import_edges(module) if _room(edge) not in ("", _room(module)))
    cycles = import_cycles(graph)
    assert not cycles, "import cycles between rooms:\n" + "\n".join(" -> ".join(c) for c in cycles)
