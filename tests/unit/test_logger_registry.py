"""One registry of the recipes' loggers (:data:`lightning_4d.recipes.loggers.LOGGERS`): the schema's check, the
installed-package check and the builder all read it, and every choice has its ``conf/logger/`` file — so a name
added in one place cannot fail later with a ``KeyError`` in another."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_4d.recipes import conf_dir
from lightning_4d.recipes.loggers import LOGGERS, LoggerConfig, LoggerKind, build_logger_list, check_logger


def test_every_choice_is_one_record_with_its_config_file_and_builder() -> None:
    files = {p.stem for p in Path(conf_dir(), "logger").glob("*.yaml")}
    assert set(LOGGERS) == files, "one conf/logger/<name>.yaml per LOGGERS entry, and no other"
    for name, kind in LOGGERS.items():
        assert kind.name == name and LoggerConfig(name=name).name == name
        assert (kind.build is None) == (name == "csv") and bool(kind.modules) == bool(kind.extra)


def test_a_name_added_to_the_registry_is_known_everywhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    built: list[Path] = []

    def build(cfg: LoggerConfig, root: Path) -> object:
        built.append(root)
        return object()

    monkeypatch.setitem(LOGGERS, "mine", LoggerKind("mine", build=build))
    cfg = LoggerConfig(name="mine", csv=False)  # the schema accepts it
    check_logger("mine")
    assert len(build_logger_list(cfg, tmp_path)) == 1 and built == [tmp_path]


def test_an_unknown_name_is_refused_by_every_reader_alike() -> None:
    from lightning_4d.recipes.errors import RecipeConfigError

    with pytest.raises(RecipeConfigError, match="logger='neptune' is not one of csv, tensorboard, wandb, mlflow"):
        LoggerConfig(name="neptune")
    with pytest.raises(ValueError, match="logger='neptune' is not one of csv, tensorboard, wandb, mlflow"):
        check_logger("neptune")
