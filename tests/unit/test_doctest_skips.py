"""Doctests run (``--doctest-modules`` over the package, see ``pyproject.toml``) unless they need a process group,
a Trainer or files: every ``+SKIP`` example follows a ``>>> # not run: needs ...`` line of its docstring saying
which."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lightning_4d

ROOT = Path(lightning_4d.__file__).parent
REASON = re.compile(r">>> # not run: needs (a process group|a Trainer|files)\b")


def _docstrings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    return [(n.body[0].value.lineno, n.body[0].value.value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
            and isinstance(n.body[0].value.value, str)]


def unexplained_skips(text: str) -> list[int]:
    """Line offsets in ``text`` (a docstring) of ``+SKIP`` examples with no reason line above them."""
    out, reason = [], False
    for i, line in enumerate(text.splitlines()):
        if REASON.search(line):
            reason = True
        elif "doctest: +SKIP" in line and not reason:
            out.append(i)
    return out


def test_every_skipped_doctest_says_why() -> None:
    missing = [f"{path.relative_to(ROOT.parent)}:{start + i}" for path in sorted(ROOT.rglob("*.py"))
               for start, text in _docstrings(path) for i in unexplained_skips(text)]
    assert not missing, "add `>>> # not run: needs a process group | a Trainer | files` above:\n" + "\n".join(missing)


def test_the_reason_rule_reads_docstrings() -> None:
    assert unexplained_skips(">>> x = 1\n>>> y = f()  # doctest: +SKIP\n") == [1]
    assert unexplained_skips(">>> # not run: needs the moon\n>>> f()  # doctest: +SKIP\n") == [1]
    text = ">>> # not run: needs a Trainer\n>>> t.fit()  # doctest: +SKIP\n>>> g()  # doctest: +SKIP"
    assert unexplained_skips(text) == []
