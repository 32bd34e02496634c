"""``FourDConfig``: every option of ``FourDStrategy``, validated without a process group.

Example:
    >>> cfg = FourDConfig(tp=2, pp=2)
    >>> cfg.resolve(8).dp
    2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from lightning_4d.mesh import ParallelDims, _check_degree

__all__ = ["FourDConfig", "SCHEDULES", "MULTI_STAGE_SCHEDULES", "ACTIVATION_CHECKPOINTING", "DATA_PARALLEL",
           "SCHEDULE_SHAPES", "ScheduleShape", "check_data_parallel", "default_virtual_stages", "stage_style"]


@dataclass(frozen=True)
class ScheduleShape:
    """Where a pipeline schedule puts its stages: the one table of schedule shapes.

    Attributes:
        style: stage ↔ rank placement, ``"loop"`` (rank ``r`` holds ``r, r + pp, …``) or ``"v"`` (the stages
            zig-zag: rank 0 holds the first and the last; :mod:`lightning_4d.pipeline.partition`).
        virtual_stages: stages per rank the schedule requires; ``None``: any ``>= 2`` (default 2).

    Example:
        >>> SCHEDULE_SHAPES["zbv"]
        ScheduleShape(style='v', virtual_stages=2)
    """

    style: str
    virtual_stages: Optional[int]


#: Every torch schedule the package knows (:data:`lightning_4d.pipeline.schedules.SCHEDULES` adds torch's
#: class names); the planner, the config and the runtime read "V-shaped" and "stages per rank" here.
SCHEDULE_SHAPES: dict[str, ScheduleShape] = {
    "gpipe": ScheduleShape("loop", 1),
    "1f1b": ScheduleShape("loop", 1),
    "interleaved_1f1b": ScheduleShape("loop", None),
    "looped_bfs": ScheduleShape("loop", None),
    "interleaved_zb": ScheduleShape("loop", None),
    "zbv": ScheduleShape("v", 2),
    "dualpipev": ScheduleShape("v", 2),
}
#: The schedules ``FourDStrategy`` runs.
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
MULTI_STAGE_SCHEDULES = tuple(s for s in SCHEDULES if SCHEDULE_SHAPES[s].virtual_stages != 1)


def _shape(schedule: str) -> ScheduleShape:
    if schedule not in SCHEDULE_SHAPES:
        raise ValueError(f"schedule={schedule!r} is not known. Choose one of {', '.join(SCHEDULE_SHAPES)}.")
    return SCHEDULE_SHAPES[schedule]


def default_virtual_stages(schedule: str, pp: int) -> int:
    """Stages per rank when ``virtual_stages`` is not given: 1 without pipelining or for one-stage schedules,
    the required number for V schedules, else 2.

    Example:
        >>> default_virtual_stages("zbv", 4), default_virtual_stages("1f1b", 4), default_virtual_stages("zbv", 1)
        (2, 1, 1)
    """
    if pp == 1:
        return 1
    return _shape(schedule).virtual_stages or 2


def stage_style(schedule: str, pp: int) -> str:
    """Stage placement of ``schedule`` on ``pp`` ranks: ``"v"`` for V-shaped schedules with a pipeline, else
    ``"loop"`` (one rank has nothing to zig-zag).

    Example:
        >>> stage_style("dualpipev", 4), stage_style("dualpipev", 1), stage_style("interleaved_1f1b", 4)
        ('v', 'loop', 'loop')
    """
    return _shape(schedule).style if pp > 1 else "loop"
ACTIVATION_CHECKPOINTING = (None, "selective", "full")
DATA_PARALLEL = ("fsdp", "replicate", "hsdp")


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
    """The strategy's options. Validation is pure and identical on every rank.

    Example:
        >>> FourDConfig(schedule="zbv", pp=2).stages_per_rank
        2
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
    dp_shard: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            _check_degree(name, getattr(self, name))
        if self.dp != "auto":
            _check_degree("dp", self.dp)
        if self.microbatches is not None:
            _check_degree("microbatches", self.microbatches)
        if self.virtual_stages is not None:
            _check_degree("virtual_stages", self.virtual_stages)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not known. Choose one of {', '.join(SCHEDULES)}.")
        check_data_parallel(self.data_parallel, self.dp_shard)
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
        shape = SCHEDULE_SHAPES[self.schedule]
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
        )
