"""``FourDConfig``: every option of ``FourDStrategy``, validated without a process group.

``FourDStrategy``'s keyword arguments *are* these fields (its signature is generated from them), and the
recipes' ``parallel`` section is their structured-config schema: an option is defined and documented here once.

Example:
    >>> cfg = FourDConfig(tp=2, pp=2)
    >>> cfg.resolve(8).dp
    2
"""

from __future__ import annotations

import inspect
import signal
import typing
from pathlib import Path
from dataclasses import dataclass, fields
from functools import partial
from datetime import timedelta
from typing import Any, Literal, Optional, Sequence, Union

from lightning_4d.context_parallel.algorithm import CP_ALGORITHMS
from lightning_4d.pipeline.schedules import STRATEGY_SCHEDULES, default_virtual_stages, get_schedule_info, stage_style
from lightning_4d.plan import LayoutPlan
from lightning_4d.mesh import ParallelDims, _check_degree
from lightning_4d.speed.compile import check_compile
from lightning_4d.speed.float8 import check_float8

__all__ = ["FourDConfig", "SCHEDULES", "MULTI_STAGE_SCHEDULES", "ACTIVATION_CHECKPOINTING", "DATA_PARALLEL",
           "DEFAULT_HEARTBEAT_TIMEOUT", "DEFAULT_SIGNALS", "DEFAULT_TIMEOUT", "NONFINITE_MODES", "check_data_parallel",
           "default_virtual_stages", "options_signature", "resolve_signals", "stage_style"]


#: The schedules ``FourDStrategy`` runs; each one's facts are its record in :mod:`lightning_4d.pipeline.schedules`.
SCHEDULES = STRATEGY_SCHEDULES
MULTI_STAGE_SCHEDULES = tuple(s for s in SCHEDULES if get_schedule_info(s).multi_stage)
ACTIVATION_CHECKPOINTING = (None, "selective", "full")
DATA_PARALLEL = ("fsdp", "replicate", "hsdp")
#: What a step with a non-finite loss or gradient norm does (:mod:`lightning_4d.safety.nonfinite`).
NONFINITE_MODES = ("raise", "skip", "off")
#: The process-group timeout by default.
DEFAULT_TIMEOUT = timedelta(minutes=30)
#: Silence after which a rank is declared frozen (:mod:`lightning_4d.safety.heartbeat`).
DEFAULT_HEARTBEAT_TIMEOUT = timedelta(seconds=60)
#: Signals that save a checkpoint and stop the run (:mod:`lightning_4d.safety.preemption`).
DEFAULT_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGUSR1")


def resolve_signals(signals: Optional[Sequence[Union[str, int]]]) -> tuple[int, ...]:
    """Signal numbers from names (``"SIGTERM"``) or numbers; ``None`` or ``()`` disables. Raises ``ValueError``
    naming an unknown signal, or one that cannot be caught (``SIGKILL``, ``SIGSTOP``). Pure.

    Example:
        >>> resolve_signals(["SIGUSR2", 15]) == (signal.SIGUSR2, signal.SIGTERM)
        True
    """
    out: list[int] = []
    for item in signals or ():
        try:
            num = signal.Signals[item] if isinstance(item, str) else signal.Signals(item)
        except (KeyError, ValueError):
            raise ValueError(
                f"preemption_signals: {item!r} is not a signal of this platform. Use names such as 'SIGTERM', "
                f"'SIGUSR1' (or () to disable saving on preemption).") from None
        if num in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"preemption_signals: {num.name} cannot be caught; use e.g. 'SIGTERM' or 'SIGUSR1'.")
        out.append(int(num))
    return tuple(dict.fromkeys(out))


def _duration(name: str, value: Any, allow_none: bool) -> Optional[timedelta]:
    """``value`` if it is a positive ``timedelta`` (or ``None`` where allowed); a plain number is refused (seconds?
    minutes?) — the recipes, which write seconds, convert them first."""
    if value is None and allow_none:
        return None
    if not isinstance(value, timedelta) or value.total_seconds() <= 0:
        off = " or None (disabled)" if allow_none else ""
        raise ValueError(f"{name}={value!r} must be a datetime.timedelta longer than 0 (e.g. timedelta(minutes=5)){off}; "
                         f"a recipe's parallel.{name} is in seconds (e.g. 300).")
    return value


def check_data_parallel(mode: str, dp_shard: Optional[int] = None) -> str:
    """The one rule for ``data_parallel`` (and HSDP's ``dp_shard``); returns ``mode``.

    Example:
        >>> check_data_parallel("hsdp", dp_shard=8)
        'hsdp'
    """
    if mode not in DATA_PARALLEL:
        raise ValueError(
            f"data_parallel={mode!r} is not supported. Use 'fsdp' (FSDP2 fully_shard, shards parameters), "
            f"'replicate' (full copies, all-reduce of gradients) or 'hsdp' (FSDP2 inside groups of dp_shard "
            f"ranks, replicated across groups)."
        )
    if mode == "hsdp" and dp_shard is None:
        raise ValueError(
            "data_parallel='hsdp' needs dp_shard: the data-parallel ranks that shard each parameter (e.g. the "
            "GPUs of one node divided by tp). Pass dp_shard=N with N dividing dp."
        )
    if mode != "hsdp" and dp_shard is not None:
        raise ValueError(
            f"dp_shard={dp_shard} only applies to data_parallel='hsdp' (got {mode!r}). Set data_parallel='hsdp' "
            f"or leave dp_shard unset."
        )
    if dp_shard is not None:
        _check_degree("dp_shard", dp_shard)
    return mode


@dataclass(frozen=True)
class FourDConfig:
    """The strategy's options — every keyword of ``FourDStrategy``, in its order. Validation is pure and
    identical on every rank.

    Attributes:
        tp: tensor-parallel degree (innermost mesh axis; keep it inside a node).
        pp: pipeline-parallel degree (outermost axis).
        ep: expert-parallel degree, folded into the ``dp × tp`` ranks (must divide ``dp·tp``).
        dp: data-parallel degree or ``"auto"`` (``world / (tp·pp)``).
        sequence_parallel: shard norms and dropout along the sequence inside TP (default on).
        microbatches: pipeline micro-batches per step (default: the schedule's minimum).
        schedule: pipeline schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zbv``, ``dualpipev``.
        virtual_stages: pipeline stages per rank (default 2 for the multi-stage schedules, else 1).
        data_parallel: ``"fsdp"`` (FSDP2 ``fully_shard``), ``"replicate"``, or ``"hsdp"`` (FSDP2 over a 2-D
            ``(dp_replicate, dp_shard)`` mesh: parameters sharded inside each group of ``dp_shard`` ranks,
            e.g. a node, replicated across the groups; expert parameters stay FSDP2 over ``edp``).
        activation_checkpointing: ``None``, ``"selective"`` or ``"full"`` (per block).
        timeout: process-group timeout; a rank blocked on a failed peer raises after it.
        process_group_backend: ``"gloo"``/``"nccl"``, or a torch ``"device:backend"`` string such as
            ``"cuda:gloo"`` (several ranks sharing one GPU: gloo on CUDA tensors, refusing host tensors as NCCL
            does; ``bench/gpu_smoke.py``); default (``None``) by device: ``nccl`` on CUDA, ``gloo`` on CPU.
        sync_module_states: every rank starts from rank 0's weights even without a common seed: a model built
            for real is moved to the rank's device and broadcast from rank 0 there (64 MB buckets) before
            sharding; a model built on the meta device
            is initialised shard by shard (:mod:`lightning_4d.materialize.local_shards`) from rank 0's random state when the
            ranks' states differ (nothing is broadcast but that state).
        nonfinite: what a step whose loss or global gradient norm is NaN/inf does, decided on every rank
            together before clipping and the optimizer step: ``"raise"`` (default) stops training with
            :class:`~lightning_4d.safety.nonfinite.NonFiniteError` naming the step, the ranks and the first
            non-finite gradient / parameter; ``"skip"`` drops the step (gradients zeroed, no optimizer
            update), counts it in ``strategy.skipped_steps`` and logs it as ``skipped_steps``; ``"off"``.
        checkpoint_checksums: record a SHA-256 per file in each checkpoint's ``manifest.json`` and verify
            them when loading (default). ``False`` for huge runs: sizes only, at save and at load.
        preemption_signals: signals (names or numbers) that end the run at the next optimizer step with a
            checkpoint ``preempted-step=N.ckpt`` (in the ``ModelCheckpoint`` directory, else
            ``<default_root_dir>/checkpoints``) and exit code ``128 + signal`` on every rank (see
            :mod:`lightning_4d.safety.preemption`); default ``("SIGTERM", "SIGUSR1")``, ``()`` (or ``None``) to leave
            signals to Lightning. Stored as a tuple; one name alone is a tuple of one.
        preemption_requeue: after such a save under SLURM, run ``scontrol requeue`` (rank 0).
        heartbeat_timeout: a rank whose heartbeat (a thread, see :mod:`lightning_4d.safety.heartbeat`) is silent this
            long — stopped (SIGSTOP), frozen, deadlocked holding the GIL — ends the
            run: every other rank prints a line naming it (rank, pid, host) and exits with code 1, and a silent
            rank on the same host is killed, instead of everyone waiting for the process-group ``timeout``.
            Default 60 s (a frozen rank ends the run within about 80 s); ``None`` disables it (e.g. to pause a
            rank in a debugger).
        dp_shard: ``data_parallel="hsdp"`` only: the data-parallel ranks sharding each parameter (divides ``dp``).
        reduced_check_budget: bytes the set-up value check on a reduced, perturbed copy of the model
            (:mod:`lightning_4d.layout.reduced_check`) may hold; over it, the copy's blocks are checked in passes of
            one block, and only when one block alone exceeds it is the rewrite checked structurally only, with a
            warning. ``None`` (default): the largest rank's share plus the largest tensor, at least 256 MiB
            (:func:`~lightning_4d.layout.reduced_check.check_budget_bytes`; the planner's set-up term counts it); ``0``:
            never run it.
        plan: a :class:`~lightning_4d.plan.LayoutPlan`, or the path of its JSON file (``layout_plan.json``,
            written by the recipes; edit it to change what is sharded), applied instead of the derived one. It
            is checked against the model, the mesh and these options (paths, styles, degrees; a schedule,
            data-parallel mode or activation checkpointing other than the plan's is refused, naming both) and by the
            set-up value check like a derived plan. ``None`` (default): derive it from the model.
        async_checkpoint: write checkpoints saved during ``fit`` in the background with DCP's ``async_save``: a save
            blocks training only while this rank's shards are copied to host memory (pinned on a GPU); the files,
            their hashes, the manifest and the ``.partial`` → path swap follow in a background thread, crash-safe as
            a synchronous save. One save at a time (the next save, a load, a preemption save and the end of
            training wait for it); an error in the background raises at the next of those. Costs one host copy of
            the rank's share of the model and optimizer state (:mod:`lightning_4d.checkpoint.background`).
        cp: context-parallel degree: every sample's sequence is split over ``cp`` ranks (a mesh axis between
            ``dp`` and ``tp``; parameters replicated over it, gradients reduced over ``dp × cp``), attention
            across them exact (:mod:`lightning_4d.context_parallel`). The sequence length must be divisible
            by ``2·cp`` (zigzag load balancing).
        cp_algorithm: how attention runs across the cp ranks: ``"allgather"`` (K/V all-gathered, any head count),
            ``"ulysses"`` (q/k/v all-to-all heads ↔ sequence; every attention call's query and K/V heads per tp rank
            must divide by ``cp``, else refused at set-up naming the module), ``"ring"`` (K/V passed around the cp
            ranks, the next chunk's transfer overlapping the attention; any head count) or ``"auto"`` (default: the
            least activation memory, then the fewest bytes, among those the heads allow: Ulysses where the heads
            divide, else the ring). The layout plan names the choice.
        nccl_flight_recorder: switch NCCL's flight recorder and its dump on a watchdog timeout on where the
            environment does not set them (``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``, before the
            process group starts: :mod:`lightning_4d.safety.nccl_debug`); default on, ``False`` leaves the
            environment alone.
        compile: ``torch.compile`` each transformer block (:mod:`lightning_4d.speed.compile`): ``True``
            (Inductor), ``False`` (default, eager) or a backend name (``"aot_eager"``, ``"eager"``: cheap, for
            tests). After TP/SP, cp, ep and activation checkpointing, before FSDP2 (TorchTitan's order);
            ``fullgraph`` per block, without it for a block whose graph breaks; every schedule, ``zbv`` and
            ``dualpipev`` included (their split backward keeps the compiled backward's buffers: pytorch#161904).
            Inductor with ``tp > 1`` is refused (it cannot lower the TP styles' mesh ops): ``"aot_eager"`` there.
        float8: train the linear layers in Float8 with torchao (:mod:`lightning_4d.speed.float8`; the extra
            ``lightning-4d[float8]``): those with both feature counts divisible by 16, not the output head nor
            MoE experts; emulated on a CPU.
        float8_recipe: Float8 scaling: ``"tensorwise"`` (default; Float8 all-gathers under tp and FSDP2) or
            ``"rowwise"``.

    Example:
        >>> FourDConfig(schedule="zbv", pp=2).stages_per_rank
        2
        >>> FourDConfig(preemption_signals="SIGUSR1").preemption_signals, FourDConfig().timeout
        (('SIGUSR1',), datetime.timedelta(seconds=1800))
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: Union[int, Literal["auto"]] = "auto"
    sequence_parallel: bool = True
    microbatches: Optional[int] = None
    schedule: str = "1f1b"
    virtual_stages: Optional[int] = None
    data_parallel: str = "fsdp"
    activation_checkpointing: Optional[str] = None
    timeout: timedelta = DEFAULT_TIMEOUT
    process_group_backend: Optional[str] = None
    sync_module_states: bool = True
    nonfinite: str = "raise"
    checkpoint_checksums: bool = True
    preemption_signals: Optional[tuple[Union[str, int], ...]] = DEFAULT_SIGNALS
    preemption_requeue: bool = False
    heartbeat_timeout: Optional[timedelta] = DEFAULT_HEARTBEAT_TIMEOUT
    dp_shard: Optional[int] = None
    reduced_check_budget: Optional[int] = None
    cp: int = 1
    cp_algorithm: str = "auto"
    plan: Union[str, Path, LayoutPlan, None] = None
    async_checkpoint: bool = False
    nccl_flight_recorder: bool = True
    compile: Union[bool, str] = False
    float8: bool = False
    float8_recipe: str = "tensorwise"

    def __post_init__(self) -> None:
        self._check_runtime_options()
        for name in ("tp", "pp", "ep", "cp"):
            _check_degree(name, getattr(self, name))
        if self.dp != "auto":
            _check_degree("dp", self.dp)
        if self.microbatches is not None:
            _check_degree("microbatches", self.microbatches)
        if self.virtual_stages is not None:
            _check_degree("virtual_stages", self.virtual_stages)
        shape = get_schedule_info(self.schedule)  # the schedule's record; refuses an unknown name
        if not shape.strategy:
            raise ValueError(f"schedule={self.schedule!r}: FourDStrategy runs {', '.join(SCHEDULES)} (torch's "
                             f"{shape.torch_name} feeds the planner and the bubble replay only).")
        if shape.name != self.schedule:
            raise ValueError(f"schedule={self.schedule!r}: write {shape.name!r}.")
        check_data_parallel(self.data_parallel, self.dp_shard)
        if self.cp_algorithm not in CP_ALGORITHMS:
            raise ValueError(f"cp_algorithm={self.cp_algorithm!r} is not known. Choose one of "
                             f"{', '.join(map(repr, CP_ALGORITHMS))}.")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r} is not supported. Use None, "
                f"'selective' or 'full'."
            )
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} must be True or False.")
        if self.schedule in MULTI_STAGE_SCHEDULES and self.virtual_stages == 1:
            raise ValueError(
                f"schedule={self.schedule!r} runs several stages per rank, but virtual_stages=1. Leave "
                f"virtual_stages unset (default 2) or pick schedule='1f1b' / 'gpipe'."
            )
        if shape.style == "v" and self.virtual_stages not in (None, shape.virtual_stages):
            raise ValueError(
                f"schedule={self.schedule!r} places exactly 2 stages per rank in a V shape, but "
                f"virtual_stages={self.virtual_stages}. Leave virtual_stages unset or set it to 2."
            )
        if shape.virtual_stages == 1 and self.virtual_stages not in (None, 1):
            raise ValueError(
                f"schedule={self.schedule!r} runs one stage per rank, but virtual_stages={self.virtual_stages}. "
                f"Use schedule='interleaved_1f1b' for several stages per rank."
            )

    def _check_runtime_options(self) -> None:
        """The options beyond the layout; flags become ``bool``, signals a tuple."""
        put = partial(object.__setattr__, self)  # frozen: normalised values are set once, here
        put("timeout", _duration("timeout", self.timeout, allow_none=False))
        put("heartbeat_timeout", _duration("heartbeat_timeout", self.heartbeat_timeout, allow_none=True))
        if self.process_group_backend is not None and not isinstance(self.process_group_backend, str):
            raise ValueError(f"process_group_backend={self.process_group_backend!r} must be a backend name such as "
                             f"'gloo' or 'nccl', or None (by device).")
        if self.nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite={self.nonfinite!r} must be one of {', '.join(map(repr, NONFINITE_MODES))}.")
        for name in ("sync_module_states", "checkpoint_checksums", "preemption_requeue", "async_checkpoint",
                     "nccl_flight_recorder"):
            put(name, bool(getattr(self, name)))
        signals = self.preemption_signals
        signals = () if signals is None else (signals,) if isinstance(signals, (str, int)) else tuple(signals)
        resolve_signals(signals)
        put("preemption_signals", signals)
        if self.plan is not None and not isinstance(self.plan, (str, Path, LayoutPlan)):
            raise ValueError(f"plan={self.plan!r} must be a LayoutPlan, the path of its JSON file, or None.")
        check_compile(self.compile, self.schedule, self.pp, self.tp)  # the backend exists; Inductor with tp
        check_float8(self.float8, self.float8_recipe)
        budget = self.reduced_check_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0):
            raise ValueError(f"reduced_check_budget={budget!r} must be a number of bytes >= 0 (0: never run the "
                             f"value check on a reduced copy) or None (automatic).")

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages held by each rank (``virtual_stages``, defaulted by schedule)."""
        if self.pp == 1:
            return 1
        if self.virtual_stages is not None:
            return self.virtual_stages
        return default_virtual_stages(self.schedule, self.pp)

    def resolve(self, world_size: int) -> ParallelDims:
        """Validate against the world size and return the degrees (pure).

        Example:
            >>> FourDConfig(tp=2).resolve(4).dp
            2
        """
        return ParallelDims.from_world(
            world_size, tp=self.tp, pp=self.pp, ep=self.ep, dp=self.dp,
            sequence_parallel=self.sequence_parallel, virtual_stages=self.stages_per_rank, dp_shard=self.dp_shard,
            cp=self.cp,
        )


def options_signature(exclude: Sequence[str] = ()) -> inspect.Signature:
    """A strategy's ``__init__`` signature: ``self``, the fields of :class:`FourDConfig` but ``exclude`` (their
    defaults and types, in field order), then ``**kwargs`` for Lightning. The Trainer's and Fabric's
    ``FourDStrategy`` take their options from it.

    Example:
        >>> list(options_signature(exclude=("pp",)).parameters)[:4]
        ['self', 'tp', 'ep', 'dp']
    """
    hints = typing.get_type_hints(FourDConfig)
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([
        inspect.Parameter("self", kind),
        *(inspect.Parameter(f.name, kind, default=f.default, annotation=hints[f.name])
          for f in fields(FourDConfig) if f.name not in exclude),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation=Any),
    ], return_annotation=None)
