"""``docs/architecture.md`` is true: its generated part is fresh and every owner it names exists."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_architecture", ROOT / "docs" / "gen_architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_rooms_are_fresh() -> None:
    gen = _generator()
    page = DOC.read_text(encoding="utf-8")
    assert gen.render(page) == page, "docs/architecture.md is stale: run `python docs/gen_architecture.py`"


def test_generator_sees_every_room_and_its_imports(tmp_path: Path) -> None:
    """The table has a row per top-level module and subpackage, and a room that imports another shows it."""
    table = _generator().rooms_table()
    package = ROOT / "lightning_4d"
    expected = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    expected |= {p.name + "/" for p in package.iterdir() if (p / "__init__.py").exists()}
    rows = set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.M))
    assert rows == expected
    strategy = next(line for line in table.splitlines() if line.startswith("| `strategy.py` |"))
    assert "`config.py`" in strategy.split("|")[4]  # strategy.py imports FourDConfig


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module("lightning_4d." + ".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise LookupError(dotted)


def _owners() -> list[str]:
    section = DOC.read_text(encoding="utf-8").split("## Owners of the shared facts")[1].split("\n## ")[0]
    names: list[str] = []
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) > 3 and not line.startswith("|---") and cells[1].strip() != "fact":
            names += re.findall(r"`([A-Za-z_][\w.]*)`", cells[2])
    return names


@pytest.mark.parametrize("owner", _owners())
def test_every_owner_named_exists(owner: str) -> None:
    assert _resolve(owner) is not None


def test_no_reference_to_documents_outside_the_repository() -> None:
    for path in [DOC, ROOT / "README.md", *ROOT.joinpath("lightning_4d").rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        assert "DESIGN.md" not in text, path
        assert not re.search(r"\bthe (seed|brief)\b", text, flags=re.I), path
