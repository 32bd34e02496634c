"""The training recipe's sections: model, parallel, trainer, optim, callbacks and the top-level
:class:`TrainConfig` (the data and logger sections are in :mod:`~lightning_4d.recipes.data_schema` and
:mod:`~lightning_4d.recipes.loggers`; :mod:`~lightning_4d.recipes.schema` registers them all with Hydra).

Example:
    >>> TrainConfig().resume
    'auto'
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Union

from omegaconf import MISSING

from lightning_4d._compat.omegaconf import structured_schema
from lightning_4d.config import FourDConfig
from lightning_4d.core.precision import PRECISION_NAMES
from lightning_4d.models import GPT2Config, LlamaConfig
from lightning_4d.models.moe import MoEConfig
from lightning_4d.recipes.errors import RecipeConfigError, _non_negative, _one_of, _positive
from lightning_4d.recipes.loggers import LoggerConfig

__all__ = ["CallbacksConfig", "GPT2ModelConfig", "HFModelConfig", "LlamaModelConfig", "MONITORS", "MoEModelConfig",
           "OptimConfig", "ParallelConfig", "TrainConfig", "TrainerConfig", "check_monitors", "register_resolvers",
           "resume_mode", "run_name"]

_ACCELERATORS = ("cpu", "gpu", "cuda", "auto")


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
        lightning_4d.recipes.errors.RecipeConfigError: model.path='a' and model.config='b' are both set: ...
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
    #: unless the environment sets it (:func:`lightning_4d.recipes.launch.apply_cuda_alloc_conf`); not a Trainer
    #: argument.
    cuda_alloc_conf: Optional[str] = None

    def __post_init__(self) -> None:
        _one_of("trainer.accelerator", self.accelerator, _ACCELERATORS)
        _one_of("trainer.float32_matmul_precision", self.float32_matmul_precision, ("highest", "high", "medium"))
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
        lightning_4d.recipes.errors.RecipeConfigError: optim.schedule='step' is not one of constant, cosine, ...
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
