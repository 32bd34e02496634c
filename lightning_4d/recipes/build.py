"""Builders behind ``recipes/train.py``: config → data, model, strategy, callbacks, Trainer → training.

Each function takes the composed Hydra config (a ``DictConfig``) or the validated
:class:`~lightning_4d.recipes.schema.TrainConfig`, so they are usable from the command line, from
Hydra's compose API and from tests alike.

Example:
    >>> from hydra import compose, initialize_config_dir
    >>> from lightning_4d.recipes import conf_dir, register_configs
    >>> register_configs()
    >>> with initialize_config_dir(str(conf_dir()), version_base=None):
    ...     cfg = compose("train", ["model=tiny_dense", "parallel=none", "trainer.devices=1",
    ...                             "data=synthetic", "trainer.max_steps=2"])
    >>> # not run: needs a Trainer (and the recipe's config files); run is lightning_4d.recipes.launch.run
    >>> result = run(cfg)  # doctest: +SKIP
    >>> result.losses[-1] < result.losses[0]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_4d.recipes.preflight import (  # noqa: F401 - data_tokenizer, validate: re-exported
    META_INIT_THRESHOLD, Config, _cfg, _hf_meta_init, data_tokenizer, validate,
)
from lightning_4d.recipes.resources import count_params
from lightning_4d.recipes.resume import checkpoint_dir
from lightning_4d.recipes.schema import (
    HFDataConfig, HFModelConfig, RecipeConfigError, SyntheticDataConfig, TextDataConfig, TrainConfig, owned,
)
from lightning_4d.recipes.schema import LlamaModelConfig  # noqa: F401 - used by the examples

if TYPE_CHECKING:
    import lightning as L
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch import nn

    from lightning_4d.strategy import FourDStrategy

__all__ = [
    "build_callbacks",
    "build_data",
    "build_loggers",
    "build_model",
    "build_network",
    "build_strategy",
    "build_trainer",
    "data_tokenizer",
    "output_dir",
    "validate",
]

_RUN_DIR_ENV = "LIGHTNING_4D_RUN_DIR"


# ---------------------------------------------------------------------------------------------- paths
def output_dir(cfg: Config) -> Path:
    """Where logs and checkpoints go: ``output_dir``, else Hydra's run directory, else ``outputs/recipes``.

    Ranks started by Lightning's launcher inherit the first process's directory (an environment
    variable), so every rank agrees even across a Hydra multirun.

    Example:
        >>> output_dir(TrainConfig(output_dir="/tmp/run")).as_posix()
        '/tmp/run'
    """
    c = cfg if isinstance(cfg, TrainConfig) else None
    explicit = c.output_dir if c is not None else OmegaConf.select(cfg, "output_dir")
    if explicit:
        return Path(explicit).absolute()
    if "LOCAL_RANK" in os.environ and os.environ.get(_RUN_DIR_ENV):
        return Path(os.environ[_RUN_DIR_ENV])
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir).absolute()
    return Path("outputs/recipes").absolute()


# ---------------------------------------------------------------------------------------------- data
def build_data(cfg: Config) -> "L.LightningDataModule":
    """The DataModule of ``cfg.data`` (``TextDataModule``, ``SyntheticDataModule``, or ``HFDataModule`` for
    ``data=hf_text`` / ``data=chat``).

    Example:
        >>> from lightning_4d.recipes.schema import SyntheticDataConfig
        >>> dm = build_data(TrainConfig(model=LlamaModelConfig(), data=SyntheticDataConfig(seq_len=8)))
        >>> type(dm).__name__
        'SyntheticDataModule'
    """
    d = _cfg(cfg).data
    if isinstance(d, SyntheticDataConfig):
        from lightning_4d.data import SyntheticDataModule

        return SyntheticDataModule(
            vocab_size=d.vocab_size, seq_len=d.seq_len, batch_size=d.batch_size,
            num_train_samples=d.num_train_samples, num_val_samples=d.num_val_samples, kind=d.kind,
            period=d.period, seed=d.seed, num_workers=d.num_workers, pin_memory=d.pin_memory)
    if isinstance(d, HFDataConfig):
        from lightning_4d.data import HFDataModule

        files, val_files = ([str(Path(f).absolute()) for f in fs] if fs else None for fs in (d.files, d.val_files))
        for f in [*(files or []), *(val_files or [])]:
            if not Path(f).exists():
                raise RecipeConfigError(f"data file {f!r} (data.files / data.val_files) does not exist.")
        return HFDataModule(
            files, Path(d.data_dir).absolute(), data_tokenizer(cfg), d.format, seq_len=d.seq_len,
            batch_size=d.batch_size, val_files=val_files, val_fraction=d.val_fraction, pack=d.pack,
            mask_prompt=d.mask_prompt, num_proc=d.num_proc, num_workers=d.num_workers, seed=d.seed,
            pin_memory=d.pin_memory, text_field=d.text_field, messages_field=d.messages_field,
            prompt_field=d.prompt_field, response_field=d.response_field, system_prompt=d.system_prompt, text_sample_by=d.text_sample_by)
    assert isinstance(d, TextDataConfig)
    from lightning_4d.data import TextDataModule

    data_dir = Path(d.data_dir).absolute()
    if not d.prepare and not (data_dir / "train.bin").exists():
        raise RecipeConfigError(
            f"data.data_dir={str(data_dir)!r} holds no train.bin and data.prepare=false. Prepare it first: "
            f"python -m lightning_4d.data prepare --out {d.data_dir} --text YOUR_TEXT (or set data.prepare=true).")
    text = [str(Path(t).absolute()) for t in d.text] if d.text is not None else None
    for t in text or []:
        if not Path(t).exists():
            raise RecipeConfigError(f"data.text entry {t!r} does not exist.")
    return TextDataModule(
        data_dir=data_dir, text=text, seq_len=d.seq_len, batch_size=d.batch_size, num_workers=d.num_workers,
        tokenizer=d.tokenizer, max_bytes=d.max_bytes, val_fraction=d.val_fraction, seed=d.seed, stride=d.stride,
        pin_memory=d.pin_memory, pack=d.pack)


# ---------------------------------------------------------------------------------------------- model
def build_network(cfg: Config) -> "nn.Module":
    """The plain torch network of ``cfg.model``: ``hydra.utils.instantiate`` of its ``_target_`` (``Llama``,
    ``GPT2``, ``MoETransformer``, or :func:`~lightning_4d.recipes.hf_model.build_hf` for ``model=hf``) called
    with the model's config object, on the current default device (wrap in ``torch.device("meta")`` for an
    empty build; for ``model=hf`` with ``model.path`` that builds the model from its config and attaches its
    weights, which ``FourDStrategy`` streams into each rank's shards).

    Example:
        >>> tiny = LlamaModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, ffn_hidden=64)
        >>> net = build_network(TrainConfig(model=tiny))
        >>> type(net).__name__, sum(p.numel() for p in net.parameters())
        ('Llama', 37024)
    """
    m = _cfg(cfg).model
    return instantiate({"_target_": m._target_}, owned("model", m))


def build_model(cfg: Config, trainer: Optional["L.Trainer"] = None) -> "L.LightningModule":
    """A :class:`~lightning_4d.models.CausalLM` around :func:`build_network`, with ``cfg.optim``.

    With a ``trainer`` and ``meta_init`` (``null``: over 100M parameters; for ``model=hf`` with ``model.path``:
    whenever the directory holds safetensors) the network is built inside ``trainer.init_module(empty_init=True)``,
    i.e. on the meta device, and the strategy materialises and shards it (pretrained weights are read from the
    files tensor by tensor, each rank keeping its slices).

    Example:
        >>> lm = build_model(TrainConfig(model=LlamaModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4)))
        >>> lm.hparams.lr
        0.0003
    """
    from lightning_4d.models import CausalLM

    c = _cfg(cfg)
    if isinstance(c.model, HFModelConfig):
        meta = _hf_meta_init(c)  # pretrained: built from the config, weights streamed into the shards
    else:
        meta = c.meta_init if c.meta_init is not None else count_params(c.model).total > META_INIT_THRESHOLD
    if trainer is not None and meta:
        with trainer.init_module(empty_init=True):
            net = build_network(c)
    else:
        net = build_network(c)
    o = c.optim
    return CausalLM(net, lr=o.lr, weight_decay=o.weight_decay, betas=(o.betas[0], o.betas[1]),
                    warmup_steps=o.warmup_steps, schedule=o.schedule, decay_steps=o.decay_steps,
                    min_lr_ratio=o.min_lr_ratio)


# ---------------------------------------------------------------------------------------------- trainer
def build_strategy(cfg: Config) -> FourDStrategy:
    """``hydra.utils.instantiate`` of ``cfg.parallel``'s ``_target_`` (``FourDStrategy``) with every option of its
    ``FourDConfig`` (the strategy's keywords).

    Example:
        >>> from lightning_4d.recipes.schema import ParallelConfig
        >>> build_strategy(TrainConfig(parallel=ParallelConfig(tp=2))).config.tp
        2
    """
    p = _cfg(cfg).parallel
    options = dataclasses.asdict(owned("parallel", p))
    return instantiate({"_target_": p._target_}, **options)


class LossHistory:
    """Callback factory: records the global ``train_loss`` of every step (same value on every rank).

    Example:
        >>> LossHistory.create().losses
        []
    """

    @staticmethod
    def create() -> L.Callback:
        """A new ``lightning.Callback`` with a ``losses`` list (read on the host when asked for, not every step)."""
        import lightning as L
        import torch

        class _LossHistory(L.Callback):
            def __init__(self) -> None:
                self._values: list[Any] = []  # device scalars: read on the host once, when asked for

            @property
            def losses(self) -> list[float]:
                values = [torch.as_tensor(v).detach().reshape(()).float().cpu() for v in self._values]
                return torch.stack(values).tolist() if values else []

            def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: STEP_OUTPUT,
                                   batch: Any, idx: int) -> None:
                value = trainer.callback_metrics.get("train_loss")
                if value is not None:
                    self._values.append(value.detach().clone() if isinstance(value, torch.Tensor) else value)

        return _LossHistory()


def build_callbacks(cfg: Config, root: Optional[Path] = None) -> list[L.Callback]:
    """Progress bar, ``ModelCheckpoint`` (under ``<output_dir>/checkpoints``), the monitors of ``callbacks.monitors``,
    the learning-rate monitor (with a logger), the layout plan's writer (``<output_dir>/layout_plan.json``) and the
    loss history (always last).

    Example:
        >>> from lightning_4d.recipes.schema import CallbacksConfig
        >>> cbs = build_callbacks(TrainConfig(callbacks=CallbacksConfig(checkpoint=False)), Path("/tmp/x"))
        >>> [type(cb).__name__ for cb in cbs]
        ['TQDMProgressBar', 'LearningRateMonitor', 'PlanWriter', '_LossHistory']
    """
    from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

    from lightning_4d.recipes.observe import observe_callbacks, plan_writer

    c = _cfg(cfg)
    root = root if root is not None else output_dir(c)
    cbs: list[L.Callback] = []
    if c.callbacks.progress_bar:
        cbs.append(TQDMProgressBar(refresh_rate=c.callbacks.progress_refresh_rate))
    if c.callbacks.checkpoint:
        # Every n steps, by default once at the last step (a run that stops mid-epoch would save nothing).
        every = c.callbacks.checkpoint_every_n_steps or (c.trainer.max_steps if c.trainer.max_steps > 0 else None)
        cbs.append(ModelCheckpoint(
            dirpath=str(checkpoint_dir(root)), every_n_train_steps=every, save_last=c.callbacks.save_last,
            save_top_k=1))
    cbs.extend(observe_callbacks(c.callbacks.monitors, c.logger))
    cbs.append(plan_writer(root))
    cbs.append(LossHistory.create())
    return cbs


def build_loggers(cfg: Config, root: Optional[Path] = None) -> list[Logger]:
    """The loggers of ``cfg.logger`` (``logger=csv|tensorboard|wandb|mlflow``), writing under ``root`` (default:
    :func:`output_dir`); see :func:`lightning_4d.recipes.observe.build_logger_list`.

    Example:
        >>> [type(lg).__name__ for lg in build_loggers(TrainConfig(), Path("/tmp/x"))]
        ['CSVLogger']
    """
    from lightning_4d.recipes.observe import build_logger_list

    c = _cfg(cfg)
    return build_logger_list(c.logger, root if root is not None else output_dir(c))


def _with_extra(callbacks: list[L.Callback], extra: Sequence[L.Callback]) -> list[L.Callback]:
    """``extra`` inserted before the loss history, which stays last."""
    return [*callbacks[:-1], *extra, callbacks[-1]] if extra else callbacks


def build_trainer(cfg: Config, root: Optional[Path] = None,
                  extra_callbacks: Sequence[L.Callback] = ()) -> "L.Trainer":
    """The ``lightning.Trainer`` of ``cfg.trainer`` with the strategy, callbacks and loggers above, plus
    ``extra_callbacks`` (before the loss history).

    Example:
        >>> # not run: needs a Trainer (and the recipe's config files)
        >>> trainer = build_trainer(TrainConfig(model=LlamaModelConfig()), Path("/tmp/x"))  # doctest: +SKIP
        >>> type(trainer.strategy).__name__  # doctest: +SKIP
        'FourDStrategy'
    """
    import lightning as L
    import torch

    c = _cfg(cfg)
    t = c.trainer
    root = root if root is not None else output_dir(c)
    loggers = build_loggers(c, root)
    torch.set_float32_matmul_precision(t.float32_matmul_precision)  # "high": fp32 matmuls may use TF32
    return L.Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=build_strategy(c),
        precision=t.precision, max_steps=t.max_steps, max_epochs=t.max_epochs,
        val_check_interval=t.val_check_interval, check_val_every_n_epoch=None if t.val_check_interval else 1,
        limit_val_batches=t.limit_val_batches, num_sanity_val_steps=t.num_sanity_val_steps,
        log_every_n_steps=t.log_every_n_steps, gradient_clip_val=t.gradient_clip_val,
        accumulate_grad_batches=t.accumulate_grad_batches, default_root_dir=str(root),
        callbacks=_with_extra(build_callbacks(c, root), extra_callbacks), logger=loggers or False,
        enable_checkpointing=c.callbacks.checkpoint,
        enable_progress_bar=c.callbacks.progress_bar, deterministic=t.deterministic,
    )
