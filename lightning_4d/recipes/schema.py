"""Typed schemas of the Hydra recipes, registered with Hydra's ``ConfigStore``.

The model and layout schemas are the package's own dataclasses (``LlamaConfig``, ``MoEConfig``, ``GPT2Config``,
``FourDConfig``; a field added there reaches the recipes as it is) with a recipe ``name`` and Hydra's
``_target_`` (the object built from them with ``hydra.utils.instantiate``). Every YAML file under ``conf/``
starts from one of these schemas (its defaults list names it first), so Hydra/OmegaConf reject a misspelt key
or a wrongly typed value while composing, naming the full key::

    $ python recipes/train.py parallel.tpp=2
    Could not override 'parallel.tpp'. ... Key 'tpp' not in 'ParallelConfig'

Value rules are those of the owners: :func:`to_train_config` builds ``FourDConfig`` and the model config
(their ``__post_init__`` runs) and names the key in their messages; the recipe-only sections (trainer, data,
optim, plan) check theirs in ``__post_init__``. Keys added with Hydra's ``+key=value`` (which bypasses the
schema) are rejected there too, with the nearest known key suggested.

The sections live in :mod:`~lightning_4d.recipes.sections` (model, parallel, trainer, optim, callbacks, the
top-level :class:`TrainConfig`), :mod:`~lightning_4d.recipes.data_schema`, :mod:`~lightning_4d.recipes.loggers` and
:mod:`~lightning_4d.recipes.plan_schema`; this module registers them and validates a composed config (every name
stays importable from here).

Schemas registered (group / name):

- ``train_schema`` — :class:`TrainConfig`, the primary config (``conf/train.yaml``).
- ``plan_schema`` — :class:`PlanRecipeConfig`, the planner's primary config (``conf/plan.yaml``).
- ``model/base_llama``, ``model/base_gpt2``, ``model/base_moe``, ``model/base_hf`` — :data:`LlamaModelConfig`,
  :data:`GPT2ModelConfig`, :data:`MoEModelConfig`, :class:`HFModelConfig`.
- ``parallel/base_parallel`` — :data:`ParallelConfig`.
- ``trainer/base_trainer`` — :class:`TrainerConfig`.
- ``data/base_text``, ``data/base_synthetic``, ``data/base_hf_data`` — :class:`TextDataConfig`,
  :class:`SyntheticDataConfig`, :class:`HFDataConfig`.
- ``optim/base_adamw`` — :class:`OptimConfig`.
- ``logger/base_logger`` — :class:`LoggerConfig`.

Example:
    >>> from omegaconf import OmegaConf
    >>> cfg = OmegaConf.structured(ParallelConfig)
    >>> cfg.tp = 2
    >>> cfg.tpp = 2
    Traceback (most recent call last):
    ...
    omegaconf.errors.ConfigAttributeError: Key 'tpp' not in 'ParallelConfig'
        full_key: tpp
        object_type=ParallelConfig
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Union

from omegaconf import DictConfig, OmegaConf

from lightning_4d._compat.omegaconf import owner_of
from lightning_4d.recipes.data_schema import DataConfig, HFDataConfig, SyntheticDataConfig, TextDataConfig
from lightning_4d.recipes.errors import RecipeConfigError
from lightning_4d.recipes.loggers import LOGGERS, LoggerConfig
from lightning_4d.recipes.plan_schema import PlanConfig, PlanRecipeConfig
from lightning_4d.recipes.sections import (
    MONITORS, CallbacksConfig, GPT2ModelConfig, HFModelConfig, LlamaModelConfig, MoEModelConfig, OptimConfig,
    ParallelConfig, TrainConfig, TrainerConfig, check_monitors, register_resolvers, resume_mode, run_name,
)

__all__ = [
    "LOGGERS",
    "MONITORS",
    "CallbacksConfig",
    "GPT2ModelConfig",
    "HFDataConfig",
    "HFModelConfig",
    "LlamaModelConfig",
    "LoggerConfig",
    "MoEModelConfig",
    "DataConfig",
    "OptimConfig",
    "ParallelConfig",
    "PlanConfig",
    "PlanRecipeConfig",
    "RecipeConfigError",
    "SyntheticDataConfig",
    "TextDataConfig",
    "TrainConfig",
    "check_monitors",
    "register_resolvers",
    "resume_mode",
    "run_name",
    "TrainerConfig",
    "owned",
    "register_configs",
    "to_train_config",
]

_REGISTERED = False


def register_configs() -> None:
    """Register every schema with Hydra's ``ConfigStore`` (idempotent). Call before composing.

    Example:
        >>> register_configs()
        >>> from hydra.core.config_store import ConfigStore
        >>> "base_llama.yaml" in ConfigStore.instance().repo["model"]
        True
    """
    global _REGISTERED
    if _REGISTERED:
        return
    from hydra.core.config_store import ConfigStore

    register_resolvers()  # ${l4d.run_name:...} of hydra.run.dir
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="plan_schema", node=PlanRecipeConfig)
    cs.store(group="model", name="base_llama", node=LlamaModelConfig)
    cs.store(group="model", name="base_moe", node=MoEModelConfig)
    cs.store(group="model", name="base_gpt2", node=GPT2ModelConfig)
    cs.store(group="model", name="base_hf", node=HFModelConfig)
    cs.store(group="parallel", name="base_parallel", node=ParallelConfig)
    cs.store(group="trainer", name="base_trainer", node=TrainerConfig)
    cs.store(group="data", name="base_text", node=TextDataConfig)
    cs.store(group="data", name="base_synthetic", node=SyntheticDataConfig)
    cs.store(group="data", name="base_hf_data", node=HFDataConfig)
    cs.store(group="optim", name="base_adamw", node=OptimConfig)
    cs.store(group="logger", name="base_logger", node=LoggerConfig)
    _REGISTERED = True


def owned(group: str, node: Any) -> Any:
    """The package object a schema instance stands for (``FourDConfig``, ``LlamaConfig``, ...), built by its owner
    so that the owner's rules run; a broken rule is a :class:`RecipeConfigError` naming ``group.key``. Other
    objects (:class:`HFModelConfig`) are returned as they are.

    Example:
        >>> owned("parallel", ParallelConfig(tp=2)).resolve(4).dp
        2
        >>> owned("parallel", ParallelConfig(schedule="2f2b"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.errors.RecipeConfigError: parallel.schedule='2f2b' is not known. Choose one of ...
    """
    try:
        return owner_of(node)
    except (ValueError, TypeError) as err:
        msg = str(err)
        sep = "." if msg.split("=", 1)[0].isidentifier() else ": "
        raise RecipeConfigError(f"{group}{sep}{msg}") from None


def to_train_config(cfg: Union[DictConfig, TrainConfig]) -> TrainConfig:
    """Validate a composed config and return it as dataclass objects.

    Runs every rule: the recipe sections' ``__post_init__`` and the owners' (:func:`owned`) of ``model`` and
    ``parallel``; the model and data nodes must come from one of the registered schemas (a YAML file whose
    defaults list names ``base_*``).

    Raises:
        RecipeConfigError: a value breaks a rule, or ``model``/``data`` is not typed by a schema.

    Example:
        >>> cfg = OmegaConf.structured(TrainConfig)
        >>> cfg.model = OmegaConf.structured(LlamaModelConfig)
        >>> cfg.data = OmegaConf.structured(SyntheticDataConfig)
        >>> to_train_config(cfg).parallel.tp
        1
    """
    if not isinstance(cfg, TrainConfig):
        for key, bases, example in (("model", "base_llama, base_moe, base_gpt2 or base_hf", "tiny_dense"),
                                    ("data", "base_text, base_synthetic or base_hf_data", "stdlib")):
            if OmegaConf.is_missing(cfg, key) or OmegaConf.select(cfg, key) is None:
                raise RecipeConfigError(f"{key} is not set: choose one on the command line, e.g. {key}={example}.")
            typ = OmegaConf.get_type(OmegaConf.select(cfg, key))
            if typ not in _SCHEMAS[key]:
                raise RecipeConfigError(
                    f"{key} has no schema (type {getattr(typ, '__name__', typ)}): a YAML file of the {key} group "
                    f"must name its schema first in its defaults list ({bases}; see lightning_4d/recipes/schema.py).")
        _reject_unknown_keys(cfg, "")
        cfg = OmegaConf.to_object(cfg)
    assert isinstance(cfg, TrainConfig)
    owned("model", cfg.model)
    owned("parallel", cfg.parallel)
    return cfg


_SCHEMAS = {"model": (LlamaModelConfig, MoEModelConfig, GPT2ModelConfig, HFModelConfig),
            "data": (TextDataConfig, SyntheticDataConfig, HFDataConfig)}


def _reject_unknown_keys(node: DictConfig, prefix: str) -> None:
    """Keys a schema does not declare. Hydra's ``+key=value`` lifts the struct flag while applying the
    override and ``OmegaConf.to_object`` would then drop the key silently; name it instead."""
    typ = OmegaConf.get_type(node)
    if not (isinstance(typ, type) and dataclasses.is_dataclass(typ)):
        return
    known = [f.name for f in dataclasses.fields(typ)]
    for key in node.keys():
        path = f"{prefix}{key}"
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f" Did you mean {prefix}{near[0]}?" if near else f" Known keys: {', '.join(known)}."
            raise RecipeConfigError(f"{path} is not a key of {typ.__name__}.{hint}")
        if not OmegaConf.is_missing(node, key) and isinstance(node[key], DictConfig):
            _reject_unknown_keys(node[key], f"{path}.")
