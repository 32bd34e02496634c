"""``docs/moe_1t_plan.md`` is what ``python -m lightning_4d.planner.moe_1t`` gives, so its figures cannot go stale."""

from __future__ import annotations

from pathlib import Path

from lightning_4d.planner.moe_1t import document

DOC = Path(__file__).resolve().parents[2] / "docs" / "moe_1t_plan.md"


def test_the_document_is_what_the_planner_gives() -> None:
    assert DOC.read_text(encoding="utf-8") == document(), (
        "docs/moe_1t_plan.md is stale: run `python -m lightning_4d.planner.moe_1t --write docs/moe_1t_plan.md`")


def test_set_up_never_raises_a_layouts_peak() -> None:
    """Issue 31: with initialisation in pieces, every listed layout's set-up peak is below its training step's."""
    rows = 0
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 10 or not cells[0].isdigit():
            continue
        header = _header_of(line)
        peak, setup = float(cells[header.index("peak GB")]), float(cells[header.index("set-up GB")])
        assert setup <= peak, line
        rows += 1
    assert rows >= 10


def _header_of(row: str) -> list[str]:
    lines = DOC.read_text(encoding="utf-8").splitlines()
    at = lines.index(row)
    while not lines[at].startswith("| pp"):
        at -= 1
    return [c.strip() for c in lines[at].strip("|").split("|")]
