"""Pipeline parallelism building blocks over ``torch.distributed.pipelining`` (usable without Lightning).

- :mod:`~lightning_4d.pipeline.partition`: stage partitioning and stage ↔ rank placement (pure).
- :mod:`~lightning_4d.pipeline.schedules`: one record per schedule (torch class, placement, stages per rank,
  micro-batch rule, bubble, in-flight micro-batches) and the one refusal of an unknown name (pure).
- :mod:`~lightning_4d.pipeline.bubble`: bubble share of torch's own action lists under unit costs (pure).
- :mod:`~lightning_4d.pipeline.stages`: how stages run (:class:`StageForward`: a chain, or the model's own forward in
  :mod:`~lightning_4d.pipeline.staged`) and the one pruning into stage modules that keep parameter names.
- :mod:`~lightning_4d.pipeline.checks`: single-process checks that the stages in order compute the forward.
- :mod:`~lightning_4d.pipeline.tied`: first/last-stage tied weights (gradient sum).
- :mod:`~lightning_4d.pipeline.runner`: :class:`PipelineRunner` (train / eval steps, loss broadcast).
- :mod:`~lightning_4d.pipeline.instrument`: timing of the real schedule step, measured bubble.
"""

from lightning_4d.pipeline.bubble import bubble_from_actions, schedule_actions, simulate_actions
from lightning_4d.pipeline.checks import check_sequential, check_staged
from lightning_4d.pipeline.instrument import PipelineEvent, PipelineInstrument, bubble_share
from lightning_4d.pipeline.partition import partition_blocks, stage_ids_for_rank, stage_to_rank
from lightning_4d.pipeline.runner import EvalOutput, PipelineRunner
from lightning_4d.pipeline.schedules import (
    SCHEDULES,
    STRATEGY_SCHEDULES,
    ScheduleInfo,
    bubble_theory,
    default_microbatches,
    get_schedule_info,
    validate_microbatches,
)
from lightning_4d.pipeline.stages import (
    ChainForward,
    PipelineParts,
    PipelineSplit,
    StageForward,
    StageModule,
    build_pipeline_stages,
    find_pipeline_split,
    prune_stages,
)
from lightning_4d.pipeline.tied import find_tied_parameters, sync_tied_grads

__all__ = [
    "SCHEDULES",
    "STRATEGY_SCHEDULES",
    "ChainForward",
    "EvalOutput",
    "PipelineEvent",
    "PipelineInstrument",
    "PipelineParts",
    "PipelineRunner",
    "PipelineSplit",
    "ScheduleInfo",
    "StageForward",
    "StageModule",
    "bubble_from_actions",
    "bubble_share",
    "bubble_theory",
    "build_pipeline_stages",
    "check_sequential",
    "check_staged",
    "default_microbatches",
    "find_pipeline_split",
    "find_tied_parameters",
    "get_schedule_info",
    "partition_blocks",
    "prune_stages",
    "schedule_actions",
    "simulate_actions",
    "stage_ids_for_rank",
    "stage_to_rank",
    "sync_tied_grads",
    "validate_microbatches",
]
