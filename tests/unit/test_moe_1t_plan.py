"""``docs/moe_1t_plan.md`` is what ``python -m lightning_4d.planner.moe_1t`` gives, so its figures cannot go stale."""

from __future__ import annotations

from pathlib import Path

from lightning_4d.planner.moe_1t import document

DOC = Path(__file__).resolve().parents[2] / "docs" / "moe_1t_plan.md"


def test_the_document_is_what_the_planner_gives() -> None:
    assert DOC.read_text(encoding="utf-8") == document(), (
        "docs/moe_1t_plan.md is stale: run `python -m lightning_4d.planner.moe_1t --write docs/moe_1t_plan.md`")
