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
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Union

from omegaconf import MISSING, DictConfig, OmegaConf

from lightning_4d._compat.omegaconf import owner_of, structured_schema
from lightning_4d.config import FourDConfig
from lightning_4d.models import GPT2Config, LlamaConfig
from lightning_4d.models.moe import MoEConfig
from lightning_4d.core.precision import PRECISION_NAMES

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

_ACCELERATORS = ("cpu", "gpu", "cuda", "auto")


class RecipeConfigError(ValueError):
    """A recipe config value breaks a rule; the message names the key, the rule and a fix.

    Example:
        >>> str(RecipeConfigError("parallel.tp=0 must be >= 1"))
        'parallel.tp=0 must be >= 1'
    """


def _positive(key: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeConfigError(f"{key}={value!r} must be a positive integer; e.g. {key}=1.")


def _non_negative(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise RecipeConfigError(f"{key}={value!r} must be a number >= 0.")


def _one_of(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        shown = ", ".join("null" if c is None else repr(c) for c in choices)
        raise RecipeConfigError(f"{key}={value!r} is not one of {shown}.")


# ---------------------------------------------------------------------------------------------- model
# The package's own config dataclasses are the schemas (same fields, defaults and rules); the recipe adds ``name``
# (labels the run) and ``_target_`` (the network class, called with the config object by ``hydra.utils.instantiate``).
LlamaModelConfig = structured_schema(LlamaConfig, "LlamaModelConfig", __name__, name=(str, "llama"),
                                     _target_=(str, "lightning_4d.models.Llama"))
MoEModelConfig = structured_schema(MoEConfig, "MoEModelConfig", __name__, name=(str, "moe"),
                                   _target_=(str, "lightning_4d.models.moe.MoETransformer"))
GPT2ModelConfig = structured_schema(GPT2Config, "GPT2ModelConfig", __name__, name=(str, "gpt2"),
                                    _target_=(str, "lightning_4d.models.GPT2"))


@dataclass
class HFModelConfig:
    """A Hugging Face ``transformers`` causal LM (:class:`~lightning_4d.models.HFLogits`): loaded with
    ``AutoModelForCausalLM.from_pretrained(path)`` from a local directory, or built from ``config`` alone
    (a model directory or a config ``.json`` file; random init, seeded by ``seed``). Exactly one of the two.

    ``dtype``: weights' dtype (``float32``, ``bfloat16``, ``float16`` or ``auto`` = as saved; transformers'
    ``dtype``, formerly ``torch_dtype``); ``attn_implementation``: ``sdpa`` or ``eager``;
    ``trust_remote_code``: run Python files shipped in the directory; ``_target_`` builds the network from this
    config (:func:`~lightning_4d.recipes.hf_model.build_hf`). Files are checked in
    :func:`~lightning_4d.recipes.build.validate` (the vocabulary and sequence length against the data,
    head counts and blocks against the layout).

    Example:
        >>> HFModelConfig(path="my-llama").attn_implementation
        'sdpa'
        >>> HFModelConfig(path="a", config="b")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.schema.RecipeConfigError: model.path='a' and model.config='b' are both set: ...
    """

    name: str = "hf"
    path: Optional[str] = None
    config: Optional[str] = None
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    _target_: str = "lightning_4d.recipes.hf_model.build_hf"

    def __post_init__(self) -> None:
        from lightning_4d.models.hf import ATTN_IMPLEMENTATIONS, DTYPES

        if self.path is None and self.config is None:
            raise RecipeConfigError(
                "model=hf needs model.path=DIR (a local directory written by save_pretrained: config.json and "
                "weights) or model.config=DIR_OR_JSON (random init from a config, for tests).")
        if self.path is not None and self.config is not None:
            raise RecipeConfigError(
                f"model.path={self.path!r} and model.config={self.config!r} are both set: path loads pretrained "
                f"weights, config builds a random model; set one (e.g. model.config=null).")
        _one_of("model.dtype", self.dtype, tuple(DTYPES))
        _one_of("model.attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)

    @property
    def source(self) -> str:
        """``path`` or ``config``, whichever is set."""
        return self.path if self.path is not None else str(self.config)

    @property
    def source_key(self) -> str:
        """``model.path`` or ``model.config`` (for messages)."""
        return "model.path" if self.path is not None else "model.config"


if TYPE_CHECKING:
    # A model node after :func:`to_train_config` (one of the model schemas above).
    ModelConfig = Union[LlamaModelConfig, MoEModelConfig, GPT2ModelConfig, HFModelConfig]


# ---------------------------------------------------------------------------------------------- parallel
# ``FourDConfig`` is the schema: every option of ``FourDStrategy`` with its rules (durations such as ``timeout`` and
# ``heartbeat_timeout`` in seconds, ``preemption_signals`` a list); the recipe adds ``name`` and ``_target_`` (the
# strategy, built by ``hydra.utils.instantiate``).
ParallelConfig = structured_schema(FourDConfig, "ParallelConfig", __name__, name=(str, "custom"),
                                   _target_=(str, "lightning_4d.FourDStrategy"))


# ---------------------------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    """Arguments of ``lightning.Trainer`` used by the recipes (``devices`` is an int or ``"auto"``).

    Example:
        >>> TrainerConfig(devices=2).accelerator
        'cpu'
    """

    accelerator: str = "cpu"
    devices: Any = 1
    num_nodes: int = 1
    precision: str = "32-true"
    max_steps: int = 100
    max_epochs: Optional[int] = None
    val_check_interval: Optional[int] = None
    limit_val_batches: Optional[int] = 4
    num_sanity_val_steps: int = 0
    log_every_n_steps: int = 10
    gradient_clip_val: Optional[float] = 1.0
    accumulate_grad_batches: int = 1
    default_root_dir: Optional[str] = None
    deterministic: bool = False
    float32_matmul_precision: str = "highest"  # torch.set_float32_matmul_precision before the Trainer is built
    #: ``PYTORCH_CUDA_ALLOC_CONF`` for the run (e.g. ``expandable_segments:True``), set before CUDA initialises
    #: unless the environment sets it (:func:`lightning_4d.recipes.build.apply_cuda_alloc_conf`); not a Trainer
    #: argument.
    cuda_alloc_conf: Optional[str] = None

    def __post_init__(self) -> None:
        _one_of("trainer.accelerator", self.accelerator, _ACCELERATORS)
        if self.devices != "auto":
            _positive("trainer.devices", self.devices)
        _positive("trainer.num_nodes", self.num_nodes)
        _one_of("trainer.precision", str(self.precision), PRECISION_NAMES)
        if self.max_steps != -1:
            _positive("trainer.max_steps", self.max_steps)
        _positive("trainer.max_epochs", self.max_epochs, allow_none=True)
        _positive("trainer.val_check_interval", self.val_check_interval, allow_none=True)
        if self.limit_val_batches is not None:
            _non_negative("trainer.limit_val_batches", self.limit_val_batches)
        _positive("trainer.log_every_n_steps", self.log_every_n_steps)
        _positive("trainer.accumulate_grad_batches", self.accumulate_grad_batches)
        _one_of("trainer.float32_matmul_precision", self.float32_matmul_precision, ("highest", "high", "medium"))


# ---------------------------------------------------------------------------------------------- data
@dataclass
class TextDataConfig:
    """:class:`~lightning_4d.data.TextDataModule`: token files in ``data_dir``, prepared from
    ``text`` (files or directories; ``null``: the Python standard library's sources) on first use.
    ``prepare: false`` requires existing files (a directory made by ``python -m lightning_4d.data
    prepare``). A relative ``data_dir`` is relative to the directory the command was started in.
    ``batch_size`` is per data-parallel rank. ``pack: true``: exact packing, ``position_ids`` restarting after each
    file's end-of-text id (a tokenizer with one: tiktoken, Hugging Face), so attention stays within a file.

    Example:
        >>> TextDataConfig(seq_len=64).tokenizer
        'byte'
    """

    name: str = "text"
    data_dir: str = "data/stdlib"
    text: Optional[List[str]] = None
    prepare: bool = True
    tokenizer: str = "byte"
    max_bytes: Optional[int] = None
    val_fraction: float = 0.05
    seq_len: int = 128
    batch_size: int = 8
    stride: Optional[int] = None
    num_workers: int = 0
    pin_memory: Optional[bool] = None  # None: pinned when training on CUDA
    seed: int = 0
    pack: bool = False

    def __post_init__(self) -> None:
        _positive("data.seq_len", self.seq_len)
        _positive("data.batch_size", self.batch_size)
        _positive("data.max_bytes", self.max_bytes, allow_none=True)
        _positive("data.stride", self.stride, allow_none=True)
        _non_negative("data.num_workers", self.num_workers)
        if not 0.0 < self.val_fraction < 1.0:
            raise RecipeConfigError(f"data.val_fraction={self.val_fraction} must be in (0, 1).")
        if self.text is not None and not self.prepare:
            raise RecipeConfigError("data.text is given but data.prepare=false: set data.prepare=true or drop text.")


@dataclass
class SyntheticDataConfig:
    """:class:`~lightning_4d.data.SyntheticDataModule`: seeded synthetic tokens, no files.

    Example:
        >>> SyntheticDataConfig().kind
        'repeat'
    """

    name: str = "synthetic"
    vocab_size: int = 256
    seq_len: int = 128
    batch_size: int = 8
    num_train_samples: int = 4096
    num_val_samples: int = 64
    kind: str = "repeat"
    period: int = 8
    seed: int = 0
    num_workers: int = 0
    pin_memory: Optional[bool] = None  # None: pinned when training on CUDA

    def __post_init__(self) -> None:
        for key in ("vocab_size", "seq_len", "batch_size", "num_train_samples", "num_val_samples", "period"):
            _positive(f"data.{key}", getattr(self, key))
        _one_of("data.kind", self.kind, ("random", "increment", "repeat"))
        _non_negative("data.num_workers", self.num_workers)


@dataclass
class HFDataConfig:
    """:class:`~lightning_4d.data.HFDataModule`: the files users have (``files``: JSONL / JSON, Parquet, Arrow,
    CSV, text, or directories of them; read with the ``datasets`` library, nothing downloaded) tokenized with the
    model's own Hugging Face tokenizer (``tokenizer``: a local directory, or ``auto``: ``model.path``) once, in
    ``num_proc`` worker processes (``null``: by size and CPU cores), into ``data_dir``; later runs reuse the files.

    ``format``: ``text`` (each document + EOS, packed into ``seq_len`` windows; with ``pack`` exactly:
    ``position_ids`` restart after each EOS; the text in ``text_field``; text files give a row per
    ``text_sample_by``: ``document``, ``paragraph`` or ``line``) or ``chat`` (``messages_field``
    conversations, or ``prompt_field`` / ``response_field`` instruction rows, through the tokenizer's chat
    template; with ``mask_prompt`` only the answers are targets; one conversation per sample, padded, or packed
    with ``pack``, exactly: ``position_ids`` keep attention within each conversation; ``system_prompt`` added
    where a conversation has none). Validation: ``val_files``, else a
    ``val_fraction`` of the tokens (text) or of the conversations (chat, picked with ``seed``). ``batch_size`` is
    per data-parallel rank.

    Example:
        >>> HFDataConfig(files=["chat.jsonl"], format="chat").tokenizer
        'auto'
        >>> HFDataConfig(files=["a.jsonl"], format="html")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.schema.RecipeConfigError: data.format='html' is not one of 'text', 'chat'.
    """

    name: str = "hf_text"
    format: str = "text"
    files: Optional[List[str]] = None
    val_files: Optional[List[str]] = None
    tokenizer: str = "auto"
    data_dir: str = "data/hf_text"
    seq_len: int = 128
    batch_size: int = 8
    val_fraction: float = 0.05
    pack: bool = False
    mask_prompt: bool = True
    text_field: str = "text"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    system_prompt: Optional[str] = None
    text_sample_by: str = "document"
    num_proc: Optional[int] = None
    num_workers: int = 0
    pin_memory: Optional[bool] = None  # None: pinned when training on CUDA
    seed: int = 0

    def __post_init__(self) -> None:
        _one_of("data.format", self.format, ("text", "chat"))
        if not self.files:
            raise RecipeConfigError(f"data={self.name} needs data.files: local data files or directories, e.g. "
                                    f"'data.files=[my_data.jsonl]'.")
        _positive("data.seq_len", self.seq_len)
        _positive("data.batch_size", self.batch_size)
        _positive("data.num_proc", self.num_proc, allow_none=True)
        _non_negative("data.num_workers", self.num_workers)
        _one_of("data.text_sample_by", self.text_sample_by, ("document", "paragraph", "line"))
        if not self.val_files and not 0.0 < self.val_fraction < 1.0:
            raise RecipeConfigError(
                f"data.val_fraction={self.val_fraction} must be in (0, 1) (or give data.val_files).")


DataConfig = Union[TextDataConfig, SyntheticDataConfig, HFDataConfig]


# ---------------------------------------------------------------------------------------------- optim
@dataclass
class OptimConfig:
    """AdamW of :class:`~lightning_4d.models.CausalLM` and its learning-rate schedule: ``warmup_steps`` of linear
    warm-up, then ``schedule`` = ``constant``, ``cosine`` or ``linear`` decay to ``min_lr_ratio · lr`` at
    ``decay_steps`` (``null``: the run's last step, ``trainer.max_steps``); the formulas are in
    :mod:`lightning_4d.models.lr_schedule`.

    Example:
        >>> OptimConfig().betas
        [0.9, 0.95]
        >>> OptimConfig(schedule="step")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.schema.RecipeConfigError: optim.schedule='step' is not one of constant, cosine, ...
    """

    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 0
    schedule: str = "constant"
    decay_steps: Optional[int] = None
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        from lightning_4d.models.lr_schedule import check_schedule

        if not self.lr > 0:
            raise RecipeConfigError(f"optim.lr={self.lr} must be > 0.")
        _non_negative("optim.weight_decay", self.weight_decay)
        _non_negative("optim.warmup_steps", self.warmup_steps)
        _positive("optim.decay_steps", self.decay_steps, allow_none=True)
        try:
            check_schedule(self.schedule, self.warmup_steps, self.decay_steps, self.min_lr_ratio, prefix="optim.")
        except ValueError as err:
            raise RecipeConfigError(str(err)) from None
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise RecipeConfigError(f"optim.betas={list(self.betas)} must be two numbers in [0, 1).")


# name -> (the packages any one of which provides it, the pyproject extra that installs it); csv needs none.
LOGGERS: dict[str, tuple[tuple[str, ...], str]] = {
    "csv": ((), ""),
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "mlflow": (("mlflow",), "mlflow"),
}
"""The ``logger`` choices (built by :mod:`lightning_4d.recipes.observe`): the modules that provide each and the extra of ``pyproject.toml`` that installs them."""

# name -> "module:class" of the package's monitor (lightning_4d.callbacks), built with no arguments.
MONITORS: dict[str, str] = {
    "bubble": "lightning_4d.callbacks.pipeline:PipelineBubbleMonitor",
    "comm": "lightning_4d.callbacks.communication:CommunicationMonitor",
    "experts": "lightning_4d.callbacks.experts:ExpertLoadMonitor",
    "throughput": "lightning_4d.callbacks.throughput:FourDThroughputMonitor",
}
"""The names of ``callbacks.monitors`` and the callbacks they stand for (each logs every
``trainer.log_every_n_steps`` batches; see :mod:`lightning_4d.callbacks`)."""



def check_monitors(names: Sequence[str]) -> None:
    """Raise ``ValueError`` for a name of ``callbacks.monitors`` that is not a monitor, listing the valid ones.

    Example:
        >>> check_monitors(["bubble", "throughput"])
        >>> check_monitors(["bubbles"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: callbacks.monitors: 'bubbles' is not a monitor (did you mean 'bubble'?); ...
    """
    for name in names:
        if name not in MONITORS:
            near = difflib.get_close_matches(str(name), list(MONITORS), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"callbacks.monitors: {name!r} is not a monitor{hint}; the monitors are "
                             f"{', '.join(MONITORS)}, e.g. callbacks.monitors=[bubble,comm,experts,throughput].")
    if len(set(names)) != len(names):
        raise ValueError(f"callbacks.monitors={list(names)} names a monitor twice; name each once.")


_AUTO, _OFF = ("auto", "true"), ("false",)  # the words of resume (lightning_4d.recipes.resume)


def resume_mode(value: str) -> str:
    """``"auto"``, ``"false"`` or ``"path"`` for a value of ``resume`` (case-insensitive words).

    Example:
        >>> resume_mode("true")
        'auto'
    """
    word = str(value).strip().lower()
    if word in _AUTO:
        return "auto"
    if word in _OFF:
        return "false"
    if not word:
        raise RecipeConfigError("resume='' is empty: use resume=auto (the newest checkpoint of the run directory), "
                                "resume=false (start over) or resume=PATH (a checkpoint directory).")
    return "path"


def run_name(default: str) -> str:
    """The run directory's name under ``outputs/``: ``slurm-<SLURM_JOB_ID>`` in a SLURM job (a requeued job keeps
    its id, so a re-run finds its checkpoints), else ``default`` (the date and time). The resolver
    ``${l4d.run_name:...}`` of ``conf/train.yaml``'s ``hydra.run.dir``.

    Example:
        >>> run_name("2026-01-01/12-00-00") in ("2026-01-01/12-00-00", f"slurm-{os.environ.get('SLURM_JOB_ID')}")
        True
    """
    job = os.environ.get("SLURM_JOB_ID")
    return f"slurm-{job}" if job else default


def register_resolvers() -> None:
    """Register ``${l4d.run_name:DEFAULT}`` with OmegaConf (idempotent).

    Example:
        >>> register_resolvers()
        >>> from omegaconf import OmegaConf
        >>> OmegaConf.has_resolver("l4d.run_name")
        True
    """
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("l4d.run_name"):
        OmegaConf.register_new_resolver("l4d.run_name", run_name)


# ---------------------------------------------------------------------------------------------- top level
@dataclass
class CallbacksConfig:
    """Callbacks added by :func:`~lightning_4d.recipes.build.build_callbacks`: Lightning's progress bar
    (``progress_bar``, redrawn every ``progress_refresh_rate`` batches), ``ModelCheckpoint`` and the package's
    monitors named in ``monitors`` (``bubble``, ``comm``, ``experts``, ``throughput``:
    :data:`MONITORS`).

    Example:
        >>> CallbacksConfig().checkpoint
        True
    """

    progress_bar: bool = True
    progress_refresh_rate: int = 10
    checkpoint: bool = True
    checkpoint_every_n_steps: Optional[int] = None
    save_last: bool = False
    monitors: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _positive("callbacks.progress_refresh_rate", self.progress_refresh_rate)
        _positive("callbacks.checkpoint_every_n_steps", self.checkpoint_every_n_steps, allow_none=True)
        try:
            check_monitors(self.monitors)
        except ValueError as err:
            raise RecipeConfigError(str(err)) from None


@dataclass
class LoggerConfig:
    """The ``logger`` group (``conf/logger/``): ``name`` = ``csv``, ``tensorboard``, ``wandb`` or ``mlflow``, plus a
    CSV file (``csv``; the only logger of ``logger=csv``; ``logger.csv=false`` there: no logger at all).
    ``project`` / ``run_name``: the W&B project or MLflow experiment, and the run's name. ``offline`` (W&B;
    ``null``: offline unless ``WANDB_API_KEY`` is set or ``WANDB_MODE=online``) and ``tracking_uri`` (MLflow;
    ``null``: ``MLFLOW_TRACKING_URI``, else a file store in ``<output_dir>/mlruns``). Built by
    :func:`lightning_4d.recipes.observe.build_logger_list`.

    Example:
        >>> LoggerConfig().name
        'csv'
        >>> LoggerConfig(name="neptune")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.schema.RecipeConfigError: logger='neptune' is not one of csv, tensorboard, ...
    """

    name: str = "csv"
    csv: bool = True
    project: str = "lightning_4d"
    run_name: Optional[str] = None
    offline: Optional[bool] = None
    tracking_uri: Optional[str] = None

    def __post_init__(self) -> None:
        if self.name not in LOGGERS:
            raise RecipeConfigError(f"logger={self.name!r} is not one of {', '.join(LOGGERS)}; e.g. "
                                    f"logger=tensorboard (CSV is written as well unless logger.csv=false).")


@dataclass
class TrainConfig:
    """The primary config of ``recipes/train.py`` (``conf/train.yaml``).

    ``output_dir`` (``null``: Hydra's run directory, else ``outputs/recipes``) receives logs and
    checkpoints; ``check_resources`` runs the fail-fast device/memory check before anything is built;
    ``meta_init`` builds the model on the meta device (``null``: when it has over 100M parameters);
    ``resume``: ``auto`` continues from the newest checkpoint of the run directory, ``false`` starts over, a path
    names the checkpoint (:mod:`lightning_4d.recipes.resume`).

    Example:
        >>> TrainConfig().seed
        0
    """

    model: Any = MISSING
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: Any = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    output_dir: Optional[str] = None
    check_resources: bool = True
    meta_init: Optional[bool] = None
    resume: str = "auto"

    def __post_init__(self) -> None:
        resume_mode(self.resume)


# ---------------------------------------------------------------------------------------------- plan
@dataclass
class PlanConfig:
    """The ``plan`` section of ``recipes/plan.py`` (``conf/plan.yaml``): the cluster and what to report.

    ``device``: a device by name (``lightning_4d.planner.hardware.DEVICES``: ``A100-40GB``, ``A100-80GB``,
    ``H100-SXM``, ``H100-PCIe``, ``H100-NVL``, ``H100-96GB-500W``, ``H200``, ``H800``, ``cpu``; ``A100`` and ``H100``
    are aliases) or ``custom`` (then ``memory_gb``, ``peak_tflops``, ``nvlink_gb_s``, ``infiniband_gb_s`` and a
    ``family`` — ``ampere``, ``hopper``, ``cpu``: its calibrated constants — or a ``compute_efficiency`` are
    required). Any of the numbers (and ``compute_efficiency``, ``hbm_gb_s``) also overrides a named device.
    Bandwidths are GB/s per GPU and direction (NVLink inside a node, the NIC share across nodes).
    ``cpu_cores``: with ``device=cpu``, the cores the ranks of a node share (``null``: the device's).
    ``nodes`` (``null``: the layout's world / ``gpus_per_node``) × ``gpus_per_node`` (``null``:
    ``trainer.devices``) is the cluster. ``global_batch_size`` / ``seq_len`` (``null``: from ``data``),
    ``expert_imbalance`` (>= 1, 1 = uniform routing). What the planner models beyond the runtime (labelled
    "planner only" in the plan): ``selective_policy`` (what ``parallel.activation_checkpointing=selective``
    saves: ``matmuls``, the runtime's, or TorchTitan's ``every_other_matmul``), ``compile`` (``torch.compile``'d
    kernels), ``float8`` (Float8 linears), ``data_parallel`` (``zero1`` / ``zero2`` instead of
    ``parallel.data_parallel``) and ``kernels=fused`` (what Megatron / Transformer Engine's fused kernels keep for
    backward instead of PyTorch's eager kernels). ``search``: rank every layout of the cluster and show the ``top``
    ones; ``context_parallel``: the cp degrees it tries (each only where the model's attention and the sequence allow it,
    ranked like the rest; ``null``: every divisor of the world, ``[1]``: none).
    ``trace``: dry-run the real rewriting on a fake process group and compare traced bytes with the formulas,
    over ``trace_blocks`` blocks (``null``: the whole model up to 8 blocks) and the ranks ``trace_ranks``
    (``null``: one per pipeline rank). ``materialize_rank``: also set up that global rank for real in this process
    (fake process group, the whole model rewritten on meta, the rank's shards allocated and initialised:
    :func:`lightning_4d.planner.setup_rank.simulate_setup`) and print its measured peak memory and seconds next to
    the planner's set-up estimate (``null``: skip; needs host memory for one rank's share). ``output``: the JSON
    file (relative: in the run dir).

    Example:
        >>> PlanConfig().device, PlanConfig(device="custom", memory_gb=96, peak_tflops=400, nvlink_gb_s=300,
        ...                                 infiniband_gb_s=25, family="hopper").memory_gb
        ('H100', 96)
        >>> PlanConfig(device="B300")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.schema.RecipeConfigError: plan.device='B300' is not one of 'A100', ...
    """

    device: str = "H100"
    memory_gb: Optional[float] = None
    peak_tflops: Optional[float] = None
    nvlink_gb_s: Optional[float] = None
    infiniband_gb_s: Optional[float] = None
    family: Optional[str] = None
    compute_efficiency: Optional[float] = None
    hbm_gb_s: Optional[float] = None
    cpu_cores: Optional[int] = None
    gpus_per_node: Optional[int] = None
    nodes: Optional[int] = None
    global_batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    expert_imbalance: float = 1.0
    flash_attention: bool = True
    selective_policy: str = "matmuls"
    compile: bool = False
    float8: bool = False
    data_parallel: Optional[str] = None
    kernels: str = "eager"
    search: bool = False
    top: int = 5
    context_parallel: Optional[List[int]] = field(default_factory=lambda: [1, 2, 4, 8])  # search.CP_CHOICES
    trace: bool = True
    trace_blocks: Optional[int] = None
    trace_ranks: Optional[List[int]] = None
    materialize_rank: Optional[int] = None
    output: str = "plan.json"

    def __post_init__(self) -> None:
        from lightning_4d.planner.hardware import FAMILIES, device_names
        from lightning_4d.planner.spec import DATA_PARALLEL_MODES, KERNELS, SELECTIVE_POLICIES

        _one_of("plan.device", self.device, (*device_names(), "custom"))
        for key in ("memory_gb", "peak_tflops", "nvlink_gb_s", "infiniband_gb_s", "compute_efficiency", "hbm_gb_s"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise RecipeConfigError(f"plan.{key}={value!r} must be a number > 0.")
        if self.compute_efficiency is not None and self.compute_efficiency > 1:
            raise RecipeConfigError(f"plan.compute_efficiency={self.compute_efficiency} is a share of the peak: "
                                    f"use a number in (0, 1], e.g. 0.6.")
        if self.device == "custom":
            for key in ("memory_gb", "peak_tflops", "nvlink_gb_s", "infiniband_gb_s"):
                if getattr(self, key) is None:
                    raise RecipeConfigError(f"plan.device=custom needs plan.{key} (memory_gb, peak_tflops, nvlink_gb_s "
                                            f"and infiniband_gb_s describe the device).")
            if self.family is None and self.compute_efficiency is None:
                raise RecipeConfigError(
                    f"plan.device=custom needs plan.family ({', '.join(sorted(FAMILIES))}: the family's calibrated "
                    f"GEMM efficiency and constants) or plan.compute_efficiency (share of the peak a large GEMM "
                    f"reaches, e.g. 0.6).")
        if self.family is not None:
            _one_of("plan.family", self.family, tuple(sorted(FAMILIES)))
            if self.device != "custom":
                raise RecipeConfigError(f"plan.family={self.family} describes a custom device; plan.device={self.device} "
                                        f"has its own family. Set plan.device=custom, or drop plan.family.")
        _one_of("plan.selective_policy", self.selective_policy, SELECTIVE_POLICIES)
        _one_of("plan.data_parallel", self.data_parallel, (None, *DATA_PARALLEL_MODES))
        _one_of("plan.kernels", self.kernels, KERNELS)
        for key in ("gpus_per_node", "nodes", "global_batch_size", "seq_len", "trace_blocks", "cpu_cores"):
            _positive(f"plan.{key}", getattr(self, key), allow_none=True)
        _positive("plan.top", self.top)
        for cp in self.context_parallel or []:
            _positive("plan.context_parallel", cp)
        if not self.expert_imbalance >= 1.0:
            raise RecipeConfigError(
                f"plan.expert_imbalance={self.expert_imbalance} must be >= 1 (1 = uniform routing).")
        for r in self.trace_ranks or []:
            _non_negative("plan.trace_ranks", r)
        if self.materialize_rank is not None:
            _non_negative("plan.materialize_rank", self.materialize_rank)


@dataclass
class PlanRecipeConfig(TrainConfig):
    """The primary config of ``recipes/plan.py`` (``conf/plan.yaml``): the training config plus ``plan``.

    Example:
        >>> PlanRecipeConfig().plan.search
        False
    """

    plan: PlanConfig = field(default_factory=PlanConfig)


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
        lightning_4d.recipes.schema.RecipeConfigError: parallel.schedule='2f2b' is not known. Choose one of ...
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
