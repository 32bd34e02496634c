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
           "check_data_parallel"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zbv", "dualpipev")
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
        if self.schedule in ("zbv", "dualpipev") and self.virtual_stages not in (None, 2):
            raise ValueError(
                f"schedule={self.schedule!r} places exactly 2 stages per rank in a V shape, but "
                f"virtual_stages={self.virtual_stages}. Leave virtual_stages unset or set it to 2."
            )
        if self.schedule in ("gpipe", "1f1b") and self.virtual_stages not in (None, 1):
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
        return 2 if self.schedule in MULTI_STAGE_SCHEDULES else 1

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
