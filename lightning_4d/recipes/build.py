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
    >>> # not run: needs a Trainer (and the recipe's config files)
    >>> result = run(cfg)  # doctest: +SKIP
    >>> result.losses[-1] < result.losses[0]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import dataclasses
import os
import warnings
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_4d.recipes.resources import ResourceReport, check_resources, count_params, model_spec
from lightning_4d.recipes.resume import RESUME_ENV, checkpoint_dir, resume_checkpoint
from lightning_4d.recipes.schema import (
    HFDataConfig,
    HFModelConfig,
    LlamaModelConfig,  # noqa: F401 - used by the examples
    RecipeConfigError,
    SyntheticDataConfig,
    TextDataConfig,
    TrainConfig,
    owned,
    to_train_config,
)

if TYPE_CHECKING:
    import lightning as L
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch import nn

    from lightning_4d.recipes.schema import DataConfig
    from lightning_4d.strategy import FourDStrategy

__all__ = [
    "ALLOC_CONF_ENV",
    "RunResult",
    "apply_cuda_alloc_conf",
    "build_callbacks",
    "build_data",
    "build_loggers",
    "build_model",
    "build_network",
    "build_strategy",
    "build_trainer",
    "data_tokenizer",
    "output_dir",
    "run",
    "validate",
]

_RUN_DIR_ENV = "LIGHTNING_4D_RUN_DIR"
META_INIT_THRESHOLD = 100_000_000
"""With ``meta_init: null`` models with more parameters than this are built on the meta device."""

Config = Union[DictConfig, TrainConfig]


def _cfg(cfg: Config) -> TrainConfig:
    return to_train_config(cfg)


def _is_main_local_process() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("RANK", "0") == "0"


def _print(msg: str) -> None:
    if _is_main_local_process():
        print(msg, flush=True)


# ---------------------------------------------------------------------------------------------- checks
def _data_vocab(data: DataConfig) -> int:
    if isinstance(data, SyntheticDataConfig):
        return data.vocab_size
    from lightning_4d.data.tokenizer import get_tokenizer

    try:
        return get_tokenizer(data.tokenizer).vocab_size
    except (ImportError, ValueError, FileNotFoundError) as err:
        raise RecipeConfigError(f"data.tokenizer={data.tokenizer!r}: {err}") from err


def _model_dir(m: HFModelConfig) -> Path:
    source = Path(m.source).absolute()
    return source if source.is_dir() else source.parent


def data_tokenizer(cfg: Config) -> str:
    """The tokenizer of ``data=hf_text`` / ``data=chat``: ``data.tokenizer`` (a directory, made absolute), or for
    ``auto`` the model's own: the directory of ``model.path`` (``model=hf``), which must hold tokenizer files.

    Example:
        >>> from lightning_4d.recipes.schema import HFDataConfig
        >>> data_tokenizer(TrainConfig(model=LlamaModelConfig(), data=HFDataConfig(files=["a.jsonl"])))
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.schema.RecipeConfigError: data.tokenizer=auto means the tokenizer of model.path ...
    """
    from lightning_4d.data.tokenizer import is_tokenizer_dir

    c = _cfg(cfg)
    d, m = c.data, c.model
    if d.tokenizer != "auto":
        if not is_tokenizer_dir(d.tokenizer):
            raise RecipeConfigError(
                f"data.tokenizer={d.tokenizer!r} is not a directory holding a Hugging Face tokenizer (tokenizer.json, "
                f"tokenizer_config.json, ...): data={d.name} tokenizes with the model's own tokenizer; use "
                f"data.tokenizer=auto (model.path) or the directory it was saved to.")
        return str(Path(d.tokenizer).absolute())
    if not isinstance(m, HFModelConfig):
        raise RecipeConfigError(
            f"data.tokenizer=auto means the tokenizer of model.path (model=hf); with model={m.name} name the "
            f"Hugging Face tokenizer directory: data.tokenizer=DIR.")
    directory = _model_dir(m)
    if not is_tokenizer_dir(directory):
        raise RecipeConfigError(
            f"data.tokenizer=auto: {m.source_key}={m.source!r} holds no tokenizer files (tokenizer.json, "
            f"tokenizer_config.json, ...). Save the model's tokenizer there (tokenizer.save_pretrained(DIR)) or set "
            f"data.tokenizer=DIR.")
    return str(directory)


def _check_tokenizer(c: TrainConfig) -> None:
    """``model=hf`` whose directory holds a tokenizer: the data must be tokenized by that tokenizer (same
    vocabulary and special ids), or its ids would mean other tokens. Refused before anything is built."""
    from lightning_4d.data.tokenizer import HFTokenizer, check_same_tokenizer, is_tokenizer_dir, tokenizer_record
    from lightning_4d.data.tokens import TokenFile

    m, d = c.model, c.data
    if not isinstance(m, HFModelConfig) or isinstance(d, SyntheticDataConfig) or not is_tokenizer_dir(_model_dir(m)):
        return
    expected = tokenizer_record(HFTokenizer(_model_dir(m)))
    if isinstance(d, HFDataConfig):
        what, fix = f"data.tokenizer={d.tokenizer!r}", "Use data.tokenizer=auto (the model's own tokenizer)."
        recorded = tokenizer_record(HFTokenizer(d.tokenizer)) if Path(d.tokenizer) != _model_dir(m) else expected
    else:
        assert isinstance(d, TextDataConfig)
        fix = (f"Tokenize the text with the model's tokenizer: data=hf_text or data=chat (data.tokenizer=auto), or "
               f"python -m lightning_4d.data prepare --tokenizer {m.source} ...")
        train = Path(d.data_dir).absolute() / "train.bin"
        if not d.prepare and train.exists():
            what, recorded = f"data.data_dir={d.data_dir!r} ({train.name})", TokenFile(train).tokenizer_record
        else:
            what = f"data.tokenizer={d.tokenizer!r}"
            recorded = (tokenizer_record(HFTokenizer(d.tokenizer)) if is_tokenizer_dir(d.tokenizer)
                        else {"name": d.tokenizer})
    try:
        check_same_tokenizer(recorded, expected, what, fix)
    except ValueError as err:
        raise RecipeConfigError(f"{err} (The model's tokenizer is in {m.source_key}={m.source!r}.)") from None


def validate(cfg: Config) -> TrainConfig:
    """Schema rules plus cross-group rules (vocabulary and sequence length fit the model); pure.

    Example:
        >>> from lightning_4d.recipes.schema import SyntheticDataConfig
        >>> validate(TrainConfig(model=LlamaModelConfig(vocab_size=64), data=SyntheticDataConfig(vocab_size=256)))
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.schema.RecipeConfigError: data vocabulary (256 ids) exceeds model.vocab_size=64: ...
    """
    c = _cfg(cfg)
    if isinstance(c.data, HFDataConfig):
        c.data.tokenizer = data_tokenizer(c)  # auto -> the model's directory
    _check_tokenizer(c)
    if isinstance(c.model, HFModelConfig):
        _validate_hf(c)
        return c
    vocab, spec = _data_vocab(c.data), model_spec(c.model)
    if vocab > spec.vocab_size:
        raise RecipeConfigError(
            f"data vocabulary ({vocab} ids) exceeds model.vocab_size={spec.vocab_size}: raise model.vocab_size "
            f"to at least {vocab} or use a smaller tokenizer / data.vocab_size.")
    if c.data.seq_len > spec.seq_len:
        raise RecipeConfigError(f"data.seq_len={c.data.seq_len} exceeds the model's longest sequence {spec.seq_len} "
                                f"(model.max_seq_len, or model.block_size of GPT-2).")
    return c


def _validate_hf(c: TrainConfig) -> None:
    """``model=hf``: the directory or config file is usable, the data fits the model; ``meta_init=true`` with
    pretrained weights needs safetensors files."""
    from lightning_4d.recipes.hf_model import hf_shape

    m = c.model
    shape = hf_shape(m)  # raises for a missing path, no config.json, no weights
    vocab = _data_vocab(c.data)
    if vocab > shape.vocab_size:
        raise RecipeConfigError(
            f"data vocabulary ({vocab} ids) exceeds the vocab_size={shape.vocab_size} of {m.source_key}={m.source!r}: "
            f"token ids >= {shape.vocab_size} have no embedding. Use data whose ids fit (e.g. "
            f"data.vocab_size={shape.vocab_size} for data=synthetic, or text tokenized with the model's tokenizer).")
    if shape.max_positions is not None and c.data.seq_len > shape.max_positions:
        raise RecipeConfigError(
            f"data.seq_len={c.data.seq_len} exceeds max_position_embeddings={shape.max_positions} of "
            f"{m.source_key}={m.source!r}; use data.seq_len<={shape.max_positions}.")
    if c.meta_init and m.path is not None and not _has_safetensors(m.path):
        raise RecipeConfigError(
            f"meta_init=true with model.path={m.path!r}: streaming pretrained weights into each rank's shards reads "
            f"*.safetensors files and the directory holds none (pytorch_model*.bin only). Convert it once "
            f"(AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir)) or set meta_init=null to load "
            f"the whole model on every rank.")


def _has_safetensors(path: str) -> bool:
    return any(Path(path).glob("*.safetensors"))


def _hf_meta_init(c: TrainConfig) -> bool:
    """``model=hf`` on the meta device? ``model.path``: yes when the directory holds safetensors (its weights
    are then streamed into each rank's shards), unless ``meta_init=false`` (loaded whole on every rank);
    ``model.config`` (random init): as every other model (``meta_init``, ``null``: over 100M parameters)."""
    m = c.model
    if c.meta_init is not None:
        return c.meta_init
    if m.path is not None:
        return _has_safetensors(m.path)
    return count_params(m).total > META_INIT_THRESHOLD


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
            pin_memory=d.pin_memory, text_field=d.text_field, messages_field=d.messages_field, prompt_field=d.prompt_field,
            response_field=d.response_field, system_prompt=d.system_prompt, text_sample_by=d.text_sample_by)
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


# ---------------------------------------------------------------------------------------------- run
@dataclass
class RunResult:
    """What :func:`run` returns (picklable): per-step global losses, where things were written, the
    resource report and the last logged metrics.

    Example:
        >>> RunResult(losses=[2.0, 1.0]).loss_drop
        1.0
    """

    losses: list[float] = field(default_factory=list)
    output_dir: str = ""
    log_dir: Optional[str] = None
    checkpoint: Optional[str] = None
    metrics: dict[str, float] = field(default_factory=dict)
    summary: str = ""

    @property
    def loss_drop(self) -> float:
        """First minus last recorded training loss (``nan`` with fewer than two steps)."""
        return self.losses[0] - self.losses[-1] if len(self.losses) >= 2 else float("nan")


def _hydra_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", _RUN_DIR_ENV, RESUME_ENV)


def _prepare_subprocess_launch(root: Path, ckpt: Optional[Path]) -> Optional[dict[str, Optional[str]]]:
    """Make ranks started by Lightning's launcher (which re-runs ``sys.argv``) run *this* job (its directory and
    the checkpoint it resumes from).

    Returns the launch-related environment to restore after the job (``None`` in a launched rank,
    under torchrun or SLURM, where there is nothing to launch).
    """
    if "LOCAL_RANK" in os.environ:
        return None
    saved = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    os.environ[_RUN_DIR_ENV] = str(root)
    os.environ[RESUME_ENV] = str(ckpt) if ckpt is not None else ""
    if _hydra_multirun():
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import read_write

        # Without this every launched rank would run the whole sweep; give it this job's overrides.
        hc = HydraConfig.get()
        sys.argv = [sys.argv[0], *hc.overrides.task]
        # The launcher passes hydra.run.dir to the ranks: make it this job's directory (not a new one).
        with read_write(hc):
            hc.run.dir = hc.runtime.output_dir
    return saved


def _finish_launch(saved: Optional[dict[str, Optional[str]]]) -> None:
    """Undo what launching did (process group, ``LOCAL_RANK``, ``MASTER_PORT``, ...) so that the next
    run in this process (the next job of a multirun) launches its own ranks on a fresh port."""
    if saved is None:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


ALLOC_CONF_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either; the first is set


def apply_cuda_alloc_conf(value: Optional[str]) -> None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=value`` (``trainer.cuda_alloc_conf``; ``gpu.yaml``: ``expandable_segments:True``)
    where the environment sets neither allocator variable. CUDA's caching allocator reads it once, when CUDA
    initialises: :func:`run` calls this first, before anything touches a GPU, and the ranks Lightning's launcher
    starts inherit it. A value that comes too late (CUDA already initialised) is refused with a warning.

    Example:
        >>> apply_cuda_alloc_conf(None)  # nothing to set
    """
    if not value or any(name in os.environ for name in ALLOC_CONF_ENV):
        return
    import torch

    if torch.cuda.is_initialized():
        warnings.warn(f"trainer.cuda_alloc_conf={value!r} is ignored: CUDA was initialised before the recipe ran, and "
                      f"its allocator reads {ALLOC_CONF_ENV[0]} only then. Set it in the environment instead.",
                      stacklevel=2)
        return
    os.environ[ALLOC_CONF_ENV[0]] = value


def run(cfg: Config, callbacks: Sequence[L.Callback] = ()) -> RunResult:
    """Validate, check resources (fail fast), then build data, Trainer and model, and train.

    Order matters: nothing is built, downloaded or allocated before the resource check passes.
    ``callbacks``: extra Lightning callbacks for this run (when calling ``run`` from Python). ``resume``
    (default ``auto``) continues from the newest checkpoint of the run directory (:mod:`~lightning_4d.recipes.resume`).

    Example:
        >>> # not run: needs a Trainer (and the recipe's config files)
        >>> result = run(cfg)  # doctest: +SKIP
        >>> result.losses[0] > result.losses[-1]  # doctest: +SKIP
        True
    """
    import lightning as L

    from lightning_4d.recipes.observe import check_logger

    c = validate(cfg)
    apply_cuda_alloc_conf(c.trainer.cuda_alloc_conf)  # before anything initialises CUDA
    check_logger(c.logger.name)  # a logger whose package is missing fails before anything is built
    report: Optional[ResourceReport] = check_resources(c) if c.check_resources else None
    root = output_dir(c)
    ckpt = resume_checkpoint(c.resume, root)
    saved_env = _prepare_subprocess_launch(root, ckpt)
    try:
        if report is not None:
            _print(report.describe())
        L.seed_everything(c.seed, workers=True, verbose=False)
        data = build_data(c)
        trainer = build_trainer(c, root, callbacks)
        model = build_model(c, trainer)
        if trainer.logger is not None:
            hp = OmegaConf.to_container(OmegaConf.structured(c), resolve=True)
            for lg in trainer.loggers:
                lg.log_hyperparams({"recipe": hp})
        trainer.fit(model, datamodule=data, ckpt_path=str(ckpt) if ckpt is not None else None)
        log_dir = trainer.log_dir  # a broadcast: every rank calls it
        trainer.strategy.barrier("recipe_end")  # no rank tears down while another still communicates
    finally:
        _finish_launch(saved_env)
    history = next(cb for cb in trainer.callbacks if type(cb).__name__ == "_LossHistory")
    ckpt = next((cb for cb in trainer.callbacks if type(cb).__name__ == "ModelCheckpoint"), None)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    result = RunResult(
        losses=list(history.losses), output_dir=str(root), log_dir=log_dir,
        checkpoint=(ckpt.last_model_path or ckpt.best_model_path or None) if ckpt is not None else None,
        metrics=metrics, summary=report.describe() if report is not None else "")
    if result.losses:
        _print(f"train_loss: {result.losses[0]:.4f} -> {result.losses[-1]:.4f} over {len(result.losses)} steps; "
               f"logs in {result.log_dir or root}")
    return result
