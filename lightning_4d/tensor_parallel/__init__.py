"""Tensor + sequence parallelism: automatic plans by naming convention, applied with DTensor.

Example:
    >>> from lightning_4d.tensor_parallel import block_plan
"""

from lightning_4d.tensor_parallel.apply import apply_tensor_parallel, tp_styles
from lightning_4d.tensor_parallel.plan import BlockPlan, ModelPlan, block_plan, model_plan

__all__ = ["BlockPlan", "ModelPlan", "apply_tensor_parallel", "block_plan", "model_plan", "tp_styles"]
