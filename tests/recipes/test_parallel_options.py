"""One schema for the strategy's options: every keyword of ``FourDStrategy`` is a ``FourDConfig`` field, composes
as ``parallel.<name>=<value>`` in the recipes and reaches the strategy the recipe builds; the README lists them."""

from __future__ import annotations

import dataclasses
import inspect
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from lightning_4d import FourDConfig, FourDStrategy
from lightning_4d.recipes import conf_dir, register_configs
from lightning_4d.recipes.build import build_strategy
from lightning_4d.recipes.schema import ParallelConfig, RecipeConfigError, to_train_config

README = Path(__file__).resolve().parents[2] / "README.md"
OPTIONS = [p for p in inspect.signature(FourDStrategy).parameters.values() if p.kind is not p.VAR_KEYWORD]

# name -> (command-line value, the value FourDStrategy.config then holds, other overrides the value needs).
# Each differs from the default, so reaching the strategy is visible.
SAMPLES: dict[str, tuple[str, Any, list[str]]] = {
    "tp": ("2", 2, []),
    "pp": ("2", 2, []),
    "ep": ("2", 2, []),
    "dp": ("4", 4, []),
    "sequence_parallel": ("false", False, []),
    "microbatches": ("8", 8, []),
    "schedule": ("gpipe", "gpipe", []),
    "virtual_stages": ("3", 3, ["parallel.schedule=interleaved_1f1b"]),
    "data_parallel": ("replicate", "replicate", []),
    "activation_checkpointing": ("full", "full", []),
    "timeout": ("90", timedelta(seconds=90), []),
    "process_group_backend": ("gloo", "gloo", []),
    "sync_module_states": ("false", False, []),
    "nonfinite": ("skip", "skip", []),
    "checkpoint_checksums": ("false", False, []),
    "preemption_signals": ("[SIGUSR2,10]", ("SIGUSR2", 10), []),
    "preemption_requeue": ("true", True, []),
    "heartbeat_timeout": ("null", None, []),
    "dp_shard": ("2", 2, ["parallel.data_parallel=hsdp"]),
    "reduced_check_budget": ("1000", 1000, []),
    "cp": ("2", 2, []),
    "cp_algorithm": ("ulysses", "ulysses", ["parallel.cp=2"]),
    "plan": ("layout_plan.json", "layout_plan.json", []),  # a path, loaded and checked at set-up
    "async_checkpoint": ("true", True, []),
    "nccl_flight_recorder": ("false", False, []),
    "compile": ("aot_eager", "aot_eager", []),
    "float8": ("true", True, []),
    "float8_recipe": ("rowwise", "rowwise", ["parallel.float8=true"]),
}


def _compose(overrides: list[str]) -> Any:
    register_configs()
    with initialize_config_dir(str(conf_dir()), version_base=None):
        return compose("train", ["parallel=none", *overrides])


def test_the_strategys_keywords_are_the_configs_fields() -> None:
    fields = dataclasses.fields(FourDConfig)
    assert [p.name for p in OPTIONS] == [f.name for f in fields]
    assert [p.default for p in OPTIONS] == [f.default for f in fields]
    schema = [f.name for f in dataclasses.fields(ParallelConfig) if f.name not in ("name", "_target_")]
    assert schema == [f.name for f in fields]
    # the public keyword API, positionally too (in the order it always had)
    assert FourDStrategy(2, 3).config.pp == 3 and FourDStrategy(tp=2, nonfinite="skip").config.nonfinite == "skip"
    with pytest.raises(TypeError, match="tpp"):
        FourDStrategy(tpp=2)


@pytest.mark.parametrize("name", [p.name for p in OPTIONS])
def test_every_option_composes_and_reaches_the_strategy(name: str) -> None:
    assert name in SAMPLES, f"FourDStrategy option {name!r} has no sample value here: add one to SAMPLES"
    value, expected, extra = SAMPLES[name]
    default = next(p.default for p in OPTIONS if p.name == name)
    assert expected != default, f"the sample of {name} must differ from its default {default!r}"
    strategy = build_strategy(_compose([f"parallel.{name}={value}", *extra]))
    assert getattr(strategy.config, name) == expected


def test_the_runtime_options_act_on_the_strategy() -> None:
    s = build_strategy(_compose(["parallel.preemption_requeue=true", "parallel.preemption_signals=[SIGUSR2]",
                                 "parallel.process_group_backend=gloo"]))
    assert s.preemption is not None and s.preemption.requeue and s.process_group_backend == "gloo"
    assert build_strategy(_compose(["parallel.preemption_signals=[]"])).preemption is None


def test_a_wrong_option_value_names_the_key() -> None:
    with pytest.raises(RecipeConfigError, match=r"parallel\.nonfinite='maybe' must be one of 'raise', 'skip', 'off'"):
        to_train_config(_compose(["parallel.nonfinite=maybe"]))
    with pytest.raises(RecipeConfigError, match=r"parallel\.timeout=datetime.timedelta\(0\) must be a datetime.timedelta longer than 0.*in seconds"):
        to_train_config(_compose(["parallel.timeout=0"]))
    with pytest.raises(RecipeConfigError, match="'SIGNOPE' is not a signal"):
        to_train_config(_compose(["parallel.preemption_signals=[SIGNOPE]"]))


def test_readme_options_table_lists_every_option() -> None:
    text = README.read_text(encoding="utf-8")
    table = text.split("### `FourDStrategy` options", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert rows == [p.name for p in OPTIONS], "README's FourDStrategy options table: one row per option, in order"
