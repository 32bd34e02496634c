"""The modules that moved into folders by job keep their old import names for one release, with a warning."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

import pytest

import lightning_4d
from lightning_4d._compat.moved import MOVED

ROOT = Path(lightning_4d.__file__).parent


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_name_is_the_new_module_with_a_warning(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    assert not ROOT.parent.joinpath(*old.split(".")).with_suffix(".py").exists(), f"{old} still has its own file"
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        # a fresh import under the old name (an earlier test may have imported it already)
        import sys
        sys.modules.pop(old, None)
        module = importlib.import_module(old)
    assert module is new


def test_old_materialize_names_warn_and_resolve() -> None:
    from lightning_4d.materialize import local_shards
    import lightning_4d.materialize as package
    package.__dict__.pop("materialize_local_shards", None)
    with pytest.warns(DeprecationWarning, match="local_shards"):
        found = package.materialize_local_shards
    assert found is local_shards.materialize_local_shards
    with pytest.raises(AttributeError):
        package.no_such_name  # noqa: B018


def test_the_new_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for new in MOVED.values():
            importlib.import_module(new)


def test_top_level_holds_only_the_public_face() -> None:
    modules = sorted(p.stem for p in ROOT.glob("*.py"))
    assert len(modules) <= 8, modules
