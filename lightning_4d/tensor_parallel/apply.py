"""Apply tensor + sequence parallelism with DTensor ``parallelize_module`` styles.

The user's attention code runs unchanged on local tensors: inputs of an attention/MLP region are
gathered to the full sequence (SP) and its column-parallel projections return local shards
``(B, T, H/tp)``; the per-rank head counts (``n_heads`` ...) and cut widths (``split_size``) are divided
by ``tp`` so ``view`` / ``split`` calls stay right. Sequence parallelism lives between the blocks: the
code around them (embedding sums, rotary tables, masks, final norm, head) sees the full sequence.

Example:
    >>> # not run: needs a process group
    >>> apply_tensor_parallel(lightning_module, mesh, layout)  # doctest: +SKIP
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from torch import nn

from lightning_4d._compat import registered_submodule
from lightning_4d.analysis.head_bias import ArgKey, install_head_inputs
from lightning_4d.analysis.hooks import LOSS_PARALLEL, TP_PLAN, hook_call, user_hook
from lightning_4d.analysis.layer_kinds import is_conv1d
from lightning_4d.core.verify import REWRITES_ATTR
from lightning_4d.mesh import Axis, FourDMesh, ParallelDims
from lightning_4d.tensor_parallel.block_inputs import install_feature_cuts
from lightning_4d.tensor_parallel.plan import block_plan, model_plan
from lightning_4d.tensor_parallel.specs import StyleSpec, spec_of
from lightning_4d.tensor_parallel.rng import ShardedRNG, install_sharded_rng, sharded_dropout_modules
from lightning_4d.tensor_parallel.styles import (
    Colwise,
    DistributedNorm,
    GatheredColumns,
    LowRankDown,
    RegionInput,
    Rowwise,
    install_head_lists,
    install_head_slices,
    install_sequence_boundary,
)
from lightning_4d.analysis.trace import HiddenArg, ModelTrace

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TPLayout", "apply_tensor_parallel", "plan_tensor_parallel", "run_user_plan_once", "tp_styles"]

_HOOK_RAN = "_fourd_user_styles_made"  # set on a module once its user plan hook has run (TP_PLAN)


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
                    f"or give an explicit plan with {hook_call(TP_PLAN)}."
                )
            setattr(mod, attr, param)


@dataclass
class TPLayout:
    """The ``parallelize_module`` styles for the whole model and what goes with them.

    Example:
        >>> TPLayout().loss_parallel
        False
    """

    styles: dict[str, StyleSpec] = field(default_factory=dict)  # module -> its style, as data
    heads: dict[str, dict[str, int]] = field(default_factory=dict)  # region -> {attr: global value}
    local_heads: dict[str, dict[str, int]] = field(default_factory=dict)  # region -> {attr: per-rank value}
    configs: dict[str, dict[str, int]] = field(default_factory=dict)  # region -> {config attr: per-rank value}
    head_lists: dict[str, dict[str, list[tuple[int, int]]]] = field(default_factory=dict)  # owner -> {list: slices}
    head_params: dict[str, dict[str, list[tuple[int, int]]]] = field(default_factory=dict)  # owner -> {param: slices}
    # region -> {argument: (heads, slices)}: the per-head score biases (ALiBi) it receives
    head_inputs: dict[str, dict[ArgKey, tuple[int, list[tuple[int, int]]]]] = field(default_factory=dict)
    # block -> {argument: width}: cut with the column-parallel linear it meets (Gemma 4's per-layer input)
    feature_inputs: dict[str, dict[ArgKey, int]] = field(default_factory=dict)
    regions: dict[str, list[str]] = field(default_factory=dict)  # block -> TP regions (attention, MLP)
    loss_parallel: bool = False
    permutations: dict[str, tuple[list[int], int]] = field(default_factory=dict)  # param fqn -> (rows, dim)
    partial_params: list[str] = field(default_factory=list)  # replicated params whose grads are summed over tp
    boundary: Optional[tuple[str, str]] = None  # (first block, last block) that cut / gather the sequence (SP)
    hidden: HiddenArg = field(default_factory=HiddenArg)
    user_plan: bool = False  # the styles came from the module's fourd_tp_plan


def tp_styles(root: nn.Module, trace: ModelTrace, tp: int, sp: bool) -> TPLayout:
    """Plan the whole model: styles per module, head attributes to divide, regions, loss parallel.

    Example:
        >>> import torch
        >>> from lightning_4d.models import Llama, LlamaConfig
        >>> from lightning_4d.analysis.trace import trace_model
        >>> lm = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_hidden=32, max_seq_len=8))
        >>> tokens = torch.randint(0, 32, (2, 8))
        >>> trace = trace_model(lm, "layers", tokens)
        >>> layout = tp_styles(lm, trace, 2, True)
        >>> [layout.styles[f"layers.0.attention.{n}"].kind for n in ("wq", "wo")], layout.loss_parallel
        (['Colwise', 'Rowwise'], True)
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    seq = Shard(1)
    layout = TPLayout(hidden=trace.hidden)
    styles, heads = layout.styles, layout.heads
    container = root.get_submodule(trace.blocks_path)
    blocks = [(f"{trace.blocks_path}.{key}", child) for key, child in container.named_children()]
    for block_name, block in blocks:
        plan = block_plan(block, block_name, tp, trace.for_block(block_name.rpartition(".")[2]), sequence_parallel=sp)
        layout.regions[block_name] = list(plan.regions)
        for name, kind in plan.linears.items():
            fqn = f"{block_name}.{name}"
            direct = sp and name in plan.direct  # held by the block itself: its input is this rank's tokens
            if kind == "replicate":
                styles[fqn] = LowRankDown()
            elif kind == "colwise" and name in plan.gathered:
                if direct:
                    raise ValueError(
                        f"{fqn} computes replicated heads and is held directly by the block, where sequence "
                        f"parallelism gives it only this rank's tokens. Set sequence_parallel=False or implement "
                        f"{hook_call(TP_PLAN)}."
                    )
                styles[fqn] = GatheredColumns(plan.gathered[name])
            elif kind == "colwise":
                perm = plan.permutations.get(name)
                styles[fqn] = Colwise(permutation=perm, partial_input=name in plan.low_rank, sequence=direct)
                if perm is not None:
                    module = block.get_submodule(name)
                    layout.permutations[f"{fqn}.weight"] = (perm, 1 if is_conv1d(module) else 0)
                    if getattr(module, "bias", None) is not None:
                        layout.permutations[f"{fqn}.bias"] = (perm, 0)
            else:
                styles[fqn] = Rowwise(output_layouts=seq if sp else Replicate(), sequence=direct)
        for region in plan.regions:
            # One DTensor input shared by all column projections of the region: their input gradients add
            # up as a Partial and are reduced once (one all-reduce, or one reduce-scatter with SP).
            styles[f"{block_name}.{region}"] = RegionInput(sequence_parallel=sp, rows=plan.channel_rows.get(region))
        for norm in plan.dist_norms:
            styles[f"{block_name}.{norm}"] = DistributedNorm()
        if sp:
            for norm in plan.norms:
                if norm not in plan.local_norms:  # those run on this rank's tokens as they are (grads summed)
                    # A local output: a norm on a region's output (Gemma's sandwich norms) feeds the residual add.
                    styles[f"{block_name}.{norm}"] = SequenceParallel(use_local_output=True)
            for moe in (m for m in plan.moe if m not in plan.block_moe):  # those see the block's local tokens
                # Tokens stay sequence-sharded into the MoE layer (experts see local tokens).
                styles[f"{block_name}.{moe}"] = PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(seq,), use_local_output=True
                )
        for region, attrs in plan.head_attrs.items():
            heads[f"{block_name}.{region}"] = attrs
        for region, attrs in plan.local_attrs.items():
            layout.local_heads[f"{block_name}.{region}"] = attrs
        for region, attrs in plan.config_attrs.items():
            layout.configs[f"{block_name}.{region}"] = attrs
        for path, slices in plan.head_lists.items():
            owner, _, child = path.rpartition(".")
            layout.head_lists.setdefault(f"{block_name}.{owner}" if owner else block_name, {})[child] = slices
        for path, slices in plan.head_params.items():
            owner, _, pname = path.rpartition(".")
            layout.head_params.setdefault(f"{block_name}.{owner}" if owner else block_name, {})[pname] = slices
        for region, inputs in plan.head_inputs.items():
            layout.head_inputs[f"{block_name}.{region}"] = inputs
        if plan.feature_inputs:
            layout.feature_inputs[block_name] = dict(plan.feature_inputs)
        layout.partial_params += [f"{block_name}.{n}" for n in plan.partial_params]
    if not styles:
        raise ValueError(
            f"tp={tp} but no block of {trace.blocks_path} has a linear layer to shard: tensor parallelism would "
            f"change nothing. Use tp=1, or implement {hook_call(TP_PLAN)}."
        )
    if sp:
        layout.boundary = (blocks[0][0], blocks[-1][0])
    mp = model_plan(root, trace, tp)
    if mp.embedding is not None:
        # Vocab-parallel lookup; the full sequence outside the blocks (the first block cuts it under SP).
        styles[mp.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if mp.head is not None:
        styles[mp.head] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
        layout.loss_parallel = True
    layout.styles = {name: spec_of(style) for name, style in styles.items()}
    return layout


def plan_tensor_parallel(module: nn.Module, dims: ParallelDims, trace: ModelTrace,
                         tp_mesh: Optional[DeviceMesh] = None) -> TPLayout:
    """Plan TP/SP for the full model (pure; validates divisibility before anything changes). A
    ``fourd_tp_plan(self, tp_mesh, sequence_parallel)`` method on the module replaces the automatic plan: it
    returns a plan fragment ``{fqn: ParallelStyle}`` (``tp_mesh`` is ``None`` when planning without a process
    group), stored as :class:`~lightning_4d.tensor_parallel.specs.StyleSpec` values.

    Example:
        >>> # not run: needs a process group
        >>> layout = plan_tensor_parallel(lm, mesh.dims, trace, mesh[Axis.TP])  # doctest: +SKIP
    """
    hook = user_hook(module, TP_PLAN)
    if hook is not None:
        module.__dict__[_HOOK_RAN] = True
        return TPLayout(styles={name: spec_of(style) for name, style in dict(hook(tp_mesh, dims.sp)).items()},
                        loss_parallel=bool(getattr(module, LOSS_PARALLEL, False)), user_plan=True)
    return tp_styles(module, trace, dims.tp, dims.sp)


def run_user_plan_once(module: nn.Module, layout: TPLayout, tp_mesh: Optional[DeviceMesh], sp: bool) -> None:
    """Call the module's ``fourd_tp_plan`` once on a model the plan is applied to but was not planned on (the
    set-up check's copy, a plan loaded from a file): a hook that also changes the module (per-rank head counts)
    must have done so there too. Its returned styles are the plan's already.

    Example:
        >>> run_user_plan_once(nn.Linear(2, 2), TPLayout(), None, True)  # not a user's plan: nothing to do
    """
    hook = user_hook(module, TP_PLAN)
    if layout.user_plan and hook is not None and not module.__dict__.get(_HOOK_RAN):
        hook(tp_mesh, sp)
        module.__dict__[_HOOK_RAN] = True


def apply_tensor_parallel(module: nn.Module, mesh: FourDMesh, layout: TPLayout) -> None:
    """Rewrite ``module`` in place for the ``tp`` axis of ``mesh`` as ``layout`` says (what the step needs of it —
    the parameters summed over tp, whether the loss is parallel — is read from the layout plan:
    ``lightning_4d.layout.parallelize.ParallelPlan``).

    ``layout`` comes from :func:`plan_tensor_parallel` on the full model; entries for modules a pipeline
    split removed from this rank are skipped. A ``fourd_tp_plan(self, tp_mesh, sequence_parallel)``
    method on the module replaces the automatic plan: it returns ``{fqn: ParallelStyle}`` (and sets
    ``self.fourd_loss_parallel`` if the output is vocab-sharded).

    Example:
        >>> # not run: needs a process group
        >>> apply_tensor_parallel(lm, mesh, layout)  # doctest: +SKIP
    """
    from torch.distributed.tensor.parallel import parallelize_module

    dims = mesh.dims
    tp_mesh = mesh[Axis.TP]
    groups = _tied_groups(module)

    def present(name: str) -> bool:  # a pipeline split may have removed it from this rank
        found = registered_submodule(module, name)
        return found is not None and not getattr(found, "fourd_stub", False)

    styles = {name: spec.build() for name, spec in layout.styles.items() if present(name)}
    parallelize_module(module, tp_mesh, styles)
    rank = tp_mesh.get_local_rank()
    for region, attrs in layout.local_heads.items():
        if not present(region):
            continue
        target = module.get_submodule(region)
        for attr, value in attrs.items():
            target.__dict__.setdefault(REWRITES_ATTR, {})[attr] = (getattr(target, attr, None), value)
            setattr(target, attr, value)
    for region, attrs in layout.configs.items():
        if not present(region):
            continue
        target = module.get_submodule(region)
        config = copy.copy(target.config)  # this region's own copy: the model's config is shared and stays whole
        for attr, value in attrs.items():
            target.__dict__.setdefault(REWRITES_ATTR, {})[f"config.{attr}"] = (getattr(config, attr, None), value)
            setattr(config, attr, value)
        target.config = config
    for owner, lists in layout.head_lists.items():
        if present(owner):
            install_head_lists(module.get_submodule(owner), {child: s[rank] for child, s in lists.items()})
    for owner, params in layout.head_params.items():
        if present(owner):
            install_head_slices(module.get_submodule(owner), {name: s[rank] for name, s in params.items()})
    for owner, inputs in layout.head_inputs.items():
        if present(owner):
            install_head_inputs(module.get_submodule(owner), {k: (h, s[rank]) for k, (h, s) in inputs.items()})
    for owner, cuts in layout.feature_inputs.items():
        if present(owner):
            install_feature_cuts(module.get_submodule(owner), cuts, tp_mesh)
    _retie(module, groups)
    if layout.boundary is not None:
        first, last = (module.get_submodule(n) if present(n) else None for n in layout.boundary)
        install_sequence_boundary(first, last, layout.hidden, tp_mesh)
    # Dropout on sharded activations draws per-rank masks; replicated activations keep the shared stream.
    blocks = [(name, module.get_submodule(name)) for name in layout.regions if present(name)]
    tracker = ShardedRNG(tp_mesh.get_local_rank())
    install_sharded_rng(module, sharded_dropout_modules(blocks, layout.regions, dims.sp), tracker)
