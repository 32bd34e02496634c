"""Apply the layout to a LightningModule: pipeline split, TP/SP, EP, activation checkpointing, DP.

The order follows TorchTitan: split into stages first (on full tensors), then tensor and expert
parallelism on each stage, then data parallelism around everything.

Example:
    >>> plan = parallelize_module(lightning_module, mesh, FourDConfig(tp=2), "32-true")  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

from lightning_4d.activation_checkpoint import apply_activation_checkpointing
from lightning_4d.config import FourDConfig
from lightning_4d.data_parallel import apply_data_parallel
from lightning_4d.discovery import find_blocks, top_level_modules
from lightning_4d.mesh import FourDMesh

__all__ = ["ParallelPlan", "parallelize_module"]


@dataclass
class ParallelPlan:
    """What was applied to the model; the strategy and the mixin read it.

    Example:
        >>> ParallelPlan(blocks_path="layers").loss_parallel
        False
    """

    blocks_path: str = ""
    blocks: list[nn.Module] = field(default_factory=list)
    loss_parallel: bool = False
    tp_modules: list[str] = field(default_factory=list)
    pipeline: Optional[Any] = None
    expert_modules: list[str] = field(default_factory=list)


def _hook(module: nn.Module, name: str) -> Any:
    fn = getattr(module, name, None)
    return fn if callable(fn) else None


def parallelize_module(module: nn.Module, mesh: FourDMesh, config: FourDConfig, precision: str) -> ParallelPlan:
    """Rewrite ``module`` (a LightningModule, usually a ``FourDModule``) in place for ``mesh``.

    Example:
        >>> parallelize_module(lm, mesh, FourDConfig(), "32-true").blocks_path  # doctest: +SKIP
        'model.layers'
    """
    dims = mesh.dims
    path_hook = _hook(module, "fourd_blocks_path")
    blocks_path, container = find_blocks(module, path_hook() if path_hook else None)
    blocks = list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)
    plan = ParallelPlan(blocks_path=blocks_path, blocks=blocks)

    if dims.tp > 1:
        from lightning_4d.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(module, mesh, plan)

    apply_activation_checkpointing(plan.blocks, config.activation_checkpointing)

    if dims.dp > 1:
        direct = [name for name, p in module.named_parameters(recurse=False)]
        if direct:
            raise ValueError(
                f"{type(module).__name__} holds parameters directly ({', '.join(direct)}). Data parallelism wraps "
                f"submodules; move them into a submodule (e.g. self.model)."
            )
        roots = [child for _, child in top_level_modules(module)]
        for root in roots:
            inner = [b for b in plan.blocks if _is_within(b, root)]
            apply_data_parallel(root, mesh["dp"], blocks=inner, mode=config.data_parallel, precision=precision)
    return plan


def _is_within(sub: nn.Module, root: nn.Module) -> bool:
    return any(m is sub for m in root.modules())
