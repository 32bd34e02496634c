"""Layers point down: nothing below the monitors (``lightning_4d.callbacks``) or the recipes imports them — at
module level or inside a function — except the package's ``__init__`` that registers the monitors' hooks."""

from __future__ import annotations

import ast
from pathlib import Path

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
