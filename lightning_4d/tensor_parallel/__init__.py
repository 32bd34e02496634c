"""Tensor + sequence parallelism: automatic plans by naming convention, applied with DTensor.

Example:
    >>> from lightning_4d.tensor_parallel import block_plan
"""

from lightning_4d.tensor_parallel.apply import TPLayout, apply_tensor_parallel, plan_tensor_parallel, tp_styles
from lightning_4d.tensor_parallel.rng import ShardedRNG, install_sharded_rng, sharded_dropout_modules
from lightning_4d.tensor_parallel.plan import BlockPlan, ModelPlan, block_plan, model_plan

__all__ = [
    "BlockPlan",
    "ModelPlan",
    "ShardedRNG",
    "TPLayout",
    "apply_tensor_parallel",
    "block_plan",
    "install_sharded_rng",
    "model_plan",
    "plan_tensor_parallel",
    "sharded_dropout_modules",
    "tp_styles",
]
