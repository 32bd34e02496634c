"""Apply tensor + sequence parallelism with DTensor ``parallelize_module`` styles.

The user's attention code runs unchanged on local tensors: inputs of an attention/MLP region are
gathered to the full sequence (SP) and its column-parallel projections return local shards
``(B, T, H/tp)``; the per-rank head counts (``n_heads`` ...) are divided by ``tp`` so ``view``
calls stay right.

Example:
    >>> apply_tensor_parallel(lightning_module, mesh, plan)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

from lightning_4d._compat import registered_submodule
from lightning_4d.tensor_parallel.plan import block_plan, model_plan
from lightning_4d.tensor_parallel.rng import ShardedRNG, install_sharded_rng, sharded_dropout_modules

__all__ = ["TPLayout", "apply_tensor_parallel", "plan_tensor_parallel", "tp_styles"]


def _tied_groups(root: nn.Module) -> list[list[str]]:
    seen: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(name)
    return [names for names in seen.values() if len(names) > 1]


def _retie(root: nn.Module, groups: list[list[str]]) -> None:
    for names in groups:
        first_mod, _, first_attr = names[0].rpartition(".")
        param = getattr(root.get_submodule(first_mod), first_attr)
        for other in names[1:]:
            mod_name, _, attr = other.rpartition(".")
            mod = root.get_submodule(mod_name)
            current = getattr(mod, attr)
            if current is param:
                continue
            if getattr(current, "placements", None) != getattr(param, "placements", None):
                raise ValueError(
                    f"Tied parameters {names[0]} and {other} get different tensor-parallel layouts "
                    f"({getattr(param, 'placements', None)} vs {getattr(current, 'placements', None)}). Untie them "
                    f"or give an explicit plan with `fourd_tp_plan`."
                )
            setattr(mod, attr, param)


@dataclass
class TPLayout:
    """The ``parallelize_module`` styles for the whole model and what goes with them.

    Example:
        >>> TPLayout().loss_parallel
        False
    """

    styles: dict[str, Any] = field(default_factory=dict)
    heads: dict[str, dict[str, int]] = field(default_factory=dict)  # region -> {attr: global value}
    regions: dict[str, list[str]] = field(default_factory=dict)  # block -> TP regions (attention, MLP)
    loss_parallel: bool = False


def tp_styles(root: nn.Module, blocks: list[tuple[str, nn.Module]], blocks_path: str, tp: int, sp: bool) -> TPLayout:
    """Plan the whole model: styles per module, head attributes to divide, regions, loss parallel.

    Example:
        >>> layout = tp_styles(model, list(model.layers.named_children()), "layers", 2, True)  # doctest: +SKIP
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1)
    layout = TPLayout()
    styles, heads = layout.styles, layout.heads
    for block_name, block in blocks:
        plan = block_plan(block, block_name, tp)
        layout.regions[block_name] = list(plan.regions)
        for name, kind in plan.linears.items():
            if kind == "colwise":
                styles[f"{block_name}.{name}"] = ColwiseParallel()
            else:
                styles[f"{block_name}.{name}"] = RowwiseParallel(output_layouts=seq if sp else Replicate())
        for region in plan.regions:
            # One DTensor input shared by all column projections of the region: their input gradients add
            # up as a Partial and are reduced once (one all-reduce, or one reduce-scatter with SP).
            styles[f"{block_name}.{region}"] = PrepareModuleInput(
                input_layouts=(seq if sp else Replicate(),), desired_input_layouts=(Replicate(),),
                use_local_output=False,
            )
        if sp:
            for norm in plan.norms:
                styles[f"{block_name}.{norm}"] = SequenceParallel()
            for moe in plan.moe:
                # Tokens stay sequence-sharded into the MoE layer (experts see local tokens).
                styles[f"{block_name}.{moe}"] = PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(seq,), use_local_output=True
                )
        for region, attrs in plan.head_attrs.items():
            heads[f"{block_name}.{region}"] = attrs
    mp = model_plan(root, blocks_path, tp)
    if mp.embedding is not None:
        direct_sp = sp and mp.embedding_parent is None
        styles[mp.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if direct_sp else Replicate())
        if sp and mp.embedding_parent is not None:
            styles[mp.embedding_parent] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=seq, use_local_output=True
            )
    elif sp:
        raise ValueError(
            f"No token embedding (an nn.Embedding of the vocabulary size before {blocks_path}) was found, so the "
            f"sequence cannot be split on entry. Set sequence_parallel=False or implement `fourd_tp_plan`."
        )
    if sp:
        for norm in mp.final_norms:
            styles[norm] = SequenceParallel()
    if mp.head is not None:
        styles[mp.head] = ColwiseParallel(
            input_layouts=seq if sp else Replicate(), output_layouts=Shard(-1), use_local_output=False
        )
        layout.loss_parallel = True
    elif sp:
        raise ValueError(
            f"No output head (an nn.Linear after {blocks_path}) was found to gather the sequence at the end. "
            f"Set sequence_parallel=False or implement `fourd_tp_plan`."
        )
    return layout


def plan_tensor_parallel(module: nn.Module, mesh: Any, blocks_path: str) -> TPLayout:
    """Plan TP/SP for the full model (pure; validates divisibility before anything changes).

    Example:
        >>> layout = plan_tensor_parallel(lm, mesh, "model.layers")  # doctest: +SKIP
    """
    dims = mesh.dims
    hook = getattr(module, "fourd_tp_plan", None)
    if callable(hook):
        return TPLayout(styles=dict(hook(mesh["tp"], dims.sp)),
                        loss_parallel=bool(getattr(module, "fourd_loss_parallel", False)))
    container = module.get_submodule(blocks_path)
    blocks = [(f"{blocks_path}.{name}", child) for name, child in container.named_children()]
    return tp_styles(module, blocks, blocks_path, dims.tp, dims.sp)


def apply_tensor_parallel(module: nn.Module, mesh: Any, plan: Any, layout: Optional[TPLayout] = None) -> None:
    """Rewrite ``module`` in place for the ``tp`` axis of ``mesh``; records into ``plan``.

    ``layout`` (from :func:`plan_tensor_parallel` on the full model) may name modules that a pipeline
    split removed from this rank: those entries are skipped. A ``fourd_tp_plan(self, tp_mesh,
    sequence_parallel)`` method on the module replaces the automatic plan: it returns
    ``{fqn: ParallelStyle}`` (and sets ``self.fourd_loss_parallel`` if the output is vocab-sharded).

    Example:
        >>> apply_tensor_parallel(lm, mesh, ParallelPlan(blocks_path="model.layers"))  # doctest: +SKIP
    """
    from torch.distributed.tensor.parallel import parallelize_module

    dims = mesh.dims
    tp_mesh = mesh["tp"]
    layout = layout if layout is not None else plan_tensor_parallel(module, mesh, plan.blocks_path)
    groups = _tied_groups(module)

    def present(name: str) -> bool:  # a pipeline split may have removed it from this rank
        return registered_submodule(module, name) is not None

    styles = {name: style for name, style in layout.styles.items() if present(name)}
    parallelize_module(module, tp_mesh, styles)
    for region, attrs in layout.heads.items():
        if not present(region):
            continue
        target = module.get_submodule(region)
        for attr, value in attrs.items():
            setattr(target, attr, value // dims.tp)
    _retie(module, groups)
    # Dropout on sharded activations draws per-rank masks; replicated activations keep the shared stream.
    blocks = [(name, module.get_submodule(name)) for name in layout.regions if present(name)]
    tracker = ShardedRNG(tp_mesh.get_local_rank())
    install_sharded_rng(module, sharded_dropout_modules(blocks, layout.regions, dims.sp), tracker)
    plan.loss_parallel = layout.loss_parallel
    plan.tp_modules = sorted(styles)
