"""The user hooks are declared once (``lightning_4d.analysis.hooks``): every lookup and every error message naming one goes
through that module, and the table of docs/how_it_works.md lists each."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from torch import nn

import lightning_4d
from lightning_4d.analysis import hooks
from lightning_4d.analysis.hooks import (
    BLOCKS_PATH,
    LOSS_PARALLEL,
    PIPELINE_HOOKS,
    TP_PLAN,
    WEIGHT_SOURCE,
    PipelinePreHook,
    TPPlanHook,
    hook_call,
    user_hook,
    weight_source,
)

ROOT = Path(lightning_4d.__file__).parent
NAMES = [BLOCKS_PATH, TP_PLAN, LOSS_PARALLEL, *PIPELINE_HOOKS, WEIGHT_SOURCE]


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """String constants of ``path``'s code (f-string pieces included), docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_no_hook_name_is_written_outside_the_hooks_module() -> None:
    offenders = [f"{path.relative_to(ROOT.parent)}:{line}: {text[:80]!r}"
                 for path in sorted(ROOT.rglob("*.py")) if path != ROOT / "analysis" / "hooks.py"
                 for line, text in _code_strings(path) if any(name in text for name in NAMES)]
    assert not offenders, "use lightning_4d.analysis.hooks (user_hook / hook_call / the constants):\n" + "\n".join(offenders)


def test_every_hook_is_in_the_docs_table() -> None:
    readme = (ROOT.parent / "docs" / "how_it_works.md").read_text(encoding="utf-8")
    table = readme.split("\n## Hooks", 1)[1].split("\n## ", 1)[0]
    assert [name for name in NAMES if f"`{name}" not in table and f"/ `{name}" not in table] == []


def test_lookup_and_messages_follow_the_protocols() -> None:
    class Model(nn.Module):
        fourd_loss_parallel = True

        def fourd_tp_plan(self, tp_mesh, sequence_parallel):
            return {"head": sequence_parallel}

    model = Model()
    assert user_hook(model, TP_PLAN)(None, True) == {"head": True} and user_hook(model, PIPELINE_HOOKS[1]) is None
    assert isinstance(model, TPPlanHook) and not isinstance(model, PipelinePreHook)
    assert hook_call(TP_PLAN) == "`fourd_tp_plan(self, tp_mesh, sequence_parallel)`"
    assert hook_call(LOSS_PARALLEL) == "`self.fourd_loss_parallel`"
    assert [hook_call(h) for h in PIPELINE_HOOKS] == [
        "`configure_pipeline_split(self)`", "`pipeline_pre_blocks(self, inputs)`", "`pipeline_post_blocks(self, h)`"]
    assert weight_source(model) is None
    with pytest.raises(KeyError, match="not a hook method"):
        user_hook(model, "fourd_tp_plans")
    with pytest.raises(KeyError, match="not a hook method"):
        user_hook(model, LOSS_PARALLEL)  # an attribute, not a method
    assert set(NAMES) == set(hooks._PROTOCOLS)
