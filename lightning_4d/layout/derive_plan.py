"""Derive the :class:`~lightning_4d.plan.LayoutPlan` of a model: one traced forward, no change to the model.

Pure apart from the forward: it needs no process group (a user's ``fourd_tp_plan`` receives ``tp_mesh=None``
when planning without one), so ``recipes/plan.py``, the golden tests and the strategy all get the same value.

Example:
    >>> import torch
    >>> from lightning_4d.config import FourDConfig
    >>> from lightning_4d.mesh import ParallelDims
    >>> from lightning_4d.models import Llama, LlamaConfig
    >>> with torch.device("meta"):
    ...     lm = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_hidden=32, max_seq_len=8))
    >>> plan = plan_layout(lm, ParallelDims(world_size=2, tp=2), FourDConfig(tp=2))
    >>> print(plan.lines()[2])
    "layers.0": sequence cut on entry
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Optional, Sequence

from torch import nn

from lightning_4d._compat import meta_scalar_mode
from lightning_4d.config import FourDConfig
from lightning_4d.context_parallel.algorithm import AttentionHeads, choose_algorithm, describe
from lightning_4d.context_parallel.check import check_context_parallel, example_length
from lightning_4d.analysis.discovery import find_blocks
from lightning_4d.core.distributed import is_on_meta
from lightning_4d.expert_parallel import MoE
from lightning_4d.expert_parallel.inplace import find_expert_modules
from lightning_4d.expert_parallel.parallel import refuse_unrecognised_experts
from lightning_4d.expert_parallel.rewrite import find_moe_modules, mixtral_source_keys
from lightning_4d.analysis.hooks import BLOCKS_PATH, user_hook
from lightning_4d.plan import ExpertEntry, LayoutPlan
from lightning_4d.speed.compile import compile_backend
from lightning_4d.speed.float8 import EXPERTS_NOTE, float8_linear_names
from lightning_4d.mesh import ParallelDims
from lightning_4d.layout.pipeline_glue import hooks_split, uses_pipeline_hooks
from lightning_4d.pipeline.partition import partition_blocks
from lightning_4d.pipeline.schedules import get_schedule_info
from lightning_4d.pipeline.staged import check_stage_owners
from lightning_4d.pipeline.tied import check_shared_blocks
from lightning_4d.tensor_parallel import plan_tensor_parallel
from lightning_4d.analysis.trace import example_tokens, trace_model

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["check_given_plan", "check_tied_across_v_stages", "plan_layout"]


def plan_layout(module: nn.Module, dims: ParallelDims, config: Optional[FourDConfig] = None,
                tp_mesh: Optional["DeviceMesh"] = None,
                attention_heads: Optional[Sequence[AttentionHeads]] = None) -> LayoutPlan:
    """The layout plan of ``module`` (usually on the meta device; left unchanged) for ``dims``: one traced
    forward on a tiny input when ``tp > 1`` or ``pp > 1``, then the pipeline stages, the TP/SP styles and head
    rewrites, the expert modules, the wrapping modes and, with ``cp > 1``, the context-parallel algorithm (from
    ``config.cp_algorithm`` and the head counts of the model's attention calls: ``attention_heads`` as the
    strategy's set-up check traced them, else traced here). Structural refusals (divisibility, head counts,
    modules no stage can own, tied weights across V-stages, Ulysses where heads do not divide) are raised here,
    before anything changes.

    Example:
        >>> # see the module docstring
    """
    if config is None:  # the degrees alone: default options
        config = FourDConfig(tp=dims.tp, pp=dims.pp, ep=dims.ep, dp=dims.dp, cp=dims.cp,
                             sequence_parallel=dims.sequence_parallel, dp_shard=dims.dp_shard,
                             virtual_stages=dims.virtual_stages if dims.virtual_stages > 1 else None,
                             schedule="interleaved_1f1b" if dims.virtual_stages > 1 else "1f1b",
                             data_parallel="hsdp" if dims.dp_shard else "fsdp")
    path_hook = user_hook(module, BLOCKS_PATH)
    blocks_path, container = find_blocks(module, path_hook() if path_hook else None)
    keys = tuple(k for k, _ in container.named_children())
    trace, input_shape = None, None
    on_meta = is_on_meta(module)
    if dims.tp > 1 or dims.pp > 1:
        example = example_tokens(module, dims.tp)
        with meta_scalar_mode() if on_meta else nullcontext():
            trace = trace_model(module, blocks_path, example)
        first = example[0] if isinstance(example, tuple) else example
        input_shape = tuple(first.shape) if hasattr(first, "shape") else None
    stages: tuple[tuple[str, ...], ...] = ()
    hooks = dims.pp > 1 and uses_pipeline_hooks(module)
    if dims.pp > 1:
        assert trace is not None
        get_schedule_info(config.schedule)  # an unknown schedule fails here, before anything changes
        num_stages = dims.pp * dims.virtual_stages
        if hooks:
            order = tuple(hooks_split(module, blocks_path).block_keys)
        else:
            check_stage_owners(module, trace)
            order = tuple(trace.block_order)
        stages = tuple(tuple(order[i] for i in idx) for idx in partition_blocks(len(order), num_stages))
        check_tied_across_v_stages(module, blocks_path, config.schedule, dims.dp_cp)
        check_shared_blocks(module, blocks_path, order, {k: s for s, keys in enumerate(stages) for k in keys})
    block_order = tuple(trace.block_order) if trace is not None else keys
    hidden = trace.hidden if trace is not None else None
    experts = _expert_entries(module, dims.ep)
    tpl = plan_tensor_parallel(module, dims, trace, tp_mesh) if dims.tp > 1 and trace else None
    if tpl is not None:
        # Expert parallelism takes these over: their experts (and a whole MoE layer it rewrites) are accounted
        # for by the expert rewrite, not summed over tp as replicated parameters.
        owned = tuple(f"{e.path if e.kind == 'in-place' else e.layer}." for e in experts)
        tpl.partial_params = [n for n in tpl.partial_params if not n.startswith(owned)]
    post = tuple(trace.post) if trace else ()
    float8 = config.float8_recipe if config.float8 else "none"
    head = post if trace is not None or not config.float8 else _traced_post(module, blocks_path, on_meta)
    return LayoutPlan(
        compile=compile_backend(config.compile) or "none", float8=float8,
        float8_linears=float8_linear_names(module, exclude=head, experts=experts) if config.float8 else (),
        float8_experts=EXPERTS_NOTE if config.float8 and experts else "",
        degrees=(("tp", dims.tp), ("pp", dims.pp), ("ep", dims.ep), ("dp", dims.dp), ("cp", dims.cp)),
        blocks_path=blocks_path, block_order=block_order, sequence_parallel=dims.sp,
        virtual_stages=dims.virtual_stages, schedule=config.schedule,
        hidden=(hidden.position, hidden.keyword, hidden.tuple_out) if hidden is not None else (0, None, None),
        pre=tuple(trace.pre) if trace else (), post=post,
        elsewhere=tuple(trace.elsewhere) if trace else (), input_shape=input_shape,
        block_attrs={k: dict(v) for k, v in trace.block_attrs.items()} if trace else {},
        shared_args=tuple(trace.shared_args) if trace else (),
        stages=stages, pipeline_hooks=hooks,
        tensor_parallel=tpl,
        experts=experts,
        activation_checkpointing=config.activation_checkpointing or "none",
        data_parallel=config.data_parallel,
        context_parallel=describe(_cp_algorithm(module, dims, config.cp_algorithm, attention_heads))
        if dims.cp > 1 else "",
    )


def _traced_post(module: nn.Module, blocks_path: str, on_meta: bool) -> tuple[str, ...]:
    """The modules that run after the blocks (the output head: Float8's rule leaves it out), traced for a plan
    that traces nothing else (tp = pp = 1)."""
    with meta_scalar_mode() if on_meta else nullcontext():
        return tuple(trace_model(module, blocks_path, example_tokens(module, 1)).post)


def _cp_algorithm(module: nn.Module, dims: ParallelDims, requested: str,
                  heads: Optional[Sequence[AttentionHeads]]) -> str:
    """:func:`~lightning_4d.context_parallel.algorithm.choose_algorithm` for ``module``; its attention calls traced
    (one forward on a tiny example, on the meta device if the model is there) unless given."""
    if heads is None and requested != "allgather":
        tp = dims.tp if dims.sp else 1
        on_meta = is_on_meta(module)
        device = next((p.device for p in module.parameters()), None)
        tokens = example_tokens(module, seq=example_length(module, dims.cp, tp))  # (2, T)
        with meta_scalar_mode() if on_meta else nullcontext():
            heads = check_context_parallel(module, tokens.to("meta" if on_meta else device or "cpu"), None, dims.cp,
                                           0, values=False).heads
    return choose_algorithm(requested, heads or (), dims.cp, dims.tp)


def _expert_entries(module: nn.Module, ep: int) -> tuple[ExpertEntry, ...]:
    """The expert modules the rewrite makes expert-parallel: in-place experts (3-D weights), lightning_4d's MoE
    layers and, with ``ep > 1``, Mixtral-style expert lists (rewritten into that layer; at ``ep == 1`` they run as
    written). The one discovery of experts: applying the plan reads them from it. With ``ep > 1`` an MoE-looking
    module that is not recognised is refused here."""
    specs, rejected = find_expert_modules(module)
    refuse_unrecognised_experts(module, rejected, ep)
    out = [ExpertEntry(s.name, "in-place", s.num_experts) for s in specs]
    for name, mod in find_moe_modules(module):
        if isinstance(mod, MoE):
            out.append(ExpertEntry(f"{name}.experts", "moe", mod.num_experts))
        elif ep > 1:
            pre = f"{name}." if name else ""
            renames = tuple((pre + old, pre + new, index) for old, (new, index) in mixtral_source_keys(mod).items())
            out.append(ExpertEntry(name, "mixtral", len(getattr(mod, "experts", ())), renames))
    return tuple(out)


def check_given_plan(module: nn.Module, plan: LayoutPlan, dims: ParallelDims,
                     options: Optional[FourDConfig] = None) -> None:
    """Refuse a plan — derived, or given back edited — that does not fit ``module``, the mesh or the run's
    ``options`` (:meth:`~lightning_4d.plan.LayoutPlan.check`, the options compared naming both values), or whose
    own schedule's rules it breaks (a V-shaped schedule with weights tied across its first and last stage:
    :func:`check_tied_across_v_stages`). Pure, identical on every rank, before anything changes.

    Example:
        >>> plan = LayoutPlan(degrees=(("pp", 1),), blocks_path="0", block_order=())
        >>> check_given_plan(nn.Sequential(nn.ModuleList()), plan, ParallelDims(world_size=1), FourDConfig())
    """
    plan.check(module, dims, options)
    if dims.pp > 1:
        check_tied_across_v_stages(module, plan.blocks_path, plan.schedule, dims.dp_cp)


def check_tied_across_v_stages(module: nn.Module, blocks_path: str, schedule: str, dp: int) -> None:
    """Refuse weights tied outside the blocks (embedding and head) under a V-shaped schedule with ``dp > 1``:
    the first and last stage share one rank, each stage module is its own data-parallel root, and torch's
    FSDP2 / replicate cannot manage one parameter from two roots (the copies would drift). Pure, identical on
    every rank, before any collective (run while planning, and again when a plan is given back).

    Example:
        >>> check_tied_across_v_stages(nn.Linear(2, 2), "layers", "zbv", dp=2)  # nothing tied: fine
    """
    if dp == 1 or get_schedule_info(schedule).style != "v":
        return
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    prefix = blocks_path + "."
    tied = [n for n in names.values() if len(n) > 1 and not all(x.startswith(prefix) for x in n)]
    if tied:
        raise ValueError(
            f"schedule={schedule!r} places the first and last pipeline stage on one rank, and {type(module).__name__} "
            f"ties {' = '.join(tied[0])} across them; with dp={dp} data parallelism would wrap that weight in two "
            f"roots and its copies would drift. Use schedule='1f1b' or 'interleaved_1f1b', dp=1, or untie the "
            f"weights."
        )
