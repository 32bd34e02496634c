"""Apply expert parallelism to a model, and the gradient-scale rule for expert parameters.

Gradient scaling (the reasoning behind :func:`expert_grad_scale`). In the full system every rank's
loss is the mean loss of its data-parallel shard (identical across the TP ranks of that shard), and
dense gradients end up summed over sequence shards and *averaged* over ``dp``, i.e. they equal the
gradient of the global-batch mean loss ``L = (1/dp) Σ_d L_d``. An expert's gradient on its owner rank
is the sum of the contributions of all tokens routed to it from the ``ep`` ranks of its group. Summed
over the ``edp`` replicas of that expert, the ``ep`` groups cover all ``dp·tp`` ranks of the stage, and
the ``tp`` sequence shards of one data shard together give ``∂L_d/∂W``; so the sum is
``Σ_d ∂L_d/∂W = dp · ∂L/∂W``. Averaging over ``edp = dp·tp/ep`` replicas (FSDP / replicate) yields
``(ep/tp) · ∂L/∂W``. Multiplying the expert gradients by ``tp/ep`` therefore makes them equal to the
single-process full-batch gradient. Without sequence parallelism (``tp > 1``, ``ep = 1``) the ``tp`` ranks of a
data shard route the *same* tokens: each already holds ``∂L_d/∂W``, the sum over the edp replicas is
``tp · dp · ∂L/∂W`` and the factor is ``1/ep`` (= 1). So the one rule is ``(tp if sp else 1) / ep``.
The MoE layer applies this factor *by construction* (an
identity-forward / scaled-backward op on the expert weights), so the data-parallel wrapper can keep
averaging over ``edp`` as for any other parameter.

The router and shared experts are dense: like the weights of sequence-parallel norms they see only
the local sequence shard, so their gradients must be summed over ``tp`` and averaged over ``dp``.

Example:
    >>> from lightning_4d.mesh import ParallelDims
    >>> expert_grad_scale(ParallelDims.from_world(8, tp=2, ep=4))
    0.5
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch.distributed as dist
from torch import nn

from lightning_4d.expert_parallel.moe import MoE
from lightning_4d.expert_parallel.router import check_routing
from lightning_4d.analysis.hooks import TP_PLAN, hook_call
from lightning_4d.mesh import Axis

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.hooks import RemovableHandle

    from lightning_4d.expert_parallel.inplace import ExpertsSpec
    from lightning_4d.mesh import FourDMesh, ParallelDims

__all__ = ["expert_grad_scale", "check_expert_parallel", "apply_expert_parallel", "apply_inplace_expert_parallel",
           "install_token_shard_check"]


def expert_grad_scale(dims: "ParallelDims") -> float:
    """Factor ``(tp if sp else 1) / ep`` that turns edp-averaged expert gradients into full-batch gradients
    (the one owner of this rule: the strategy applies it to every kind of MoE layer).

    Assumes the conventions of the module docstring: per-rank loss = mean over its data shard (same on
    all TP ranks), tokens split over TP ranks by sequence parallelism, expert gradients averaged over
    ``edp = dp·cp·tp/ep`` (context-parallel ranks hold other tokens, like data-parallel ones). Pure.

    Example:
        >>> from lightning_4d.mesh import ParallelDims
        >>> expert_grad_scale(ParallelDims.from_world(4, ep=4)), expert_grad_scale(ParallelDims.from_world(4, tp=2))
        (0.25, 2.0)
        >>> expert_grad_scale(ParallelDims.from_world(4, tp=2, sequence_parallel=False))
        1.0
    """
    return (dims.tp if dims.sp else 1) / dims.ep


def check_expert_parallel(num_experts: int, top_k: int, ep: int, name: str = "MoE") -> None:
    """Validate an MoE layout (pure): ``top_k <= num_experts`` and ``ep`` divides ``num_experts``.

    Example:
        >>> check_expert_parallel(8, 2, ep=4)
        >>> check_expert_parallel(6, 2, ep=4, name="layers.0.moe")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: MoE layer 'layers.0.moe': num_experts=6 is not divisible by ep=4: ... Choose ep among [1, 2, 3, 6] ...
    """
    try:
        check_routing(num_experts, top_k)
    except ValueError as err:
        raise ValueError(f"MoE layer '{name}': {err}") from None
    if num_experts % ep:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"MoE layer '{name}': num_experts={num_experts} is not divisible by ep={ep}: every ep rank must hold "
            f"the same number of experts. Choose ep among {divisors} or change num_experts.")


def apply_expert_parallel(
    model: nn.Module,
    mesh: Union["FourDMesh", "DeviceMesh"],
    *,
    grad_scale: Optional[float] = None,
    stats_groups: Optional[Sequence[tuple[str, dist.ProcessGroup]]] = None,
    aux_grad_scale: Optional[float] = None,
    rewrite: bool = True,
) -> nn.Module:
    """Make every MoE layer of ``model`` expert-parallel (in place) and return the model.

    Mixtral-style blocks are first replaced by :class:`~.moe.MoE` (``rewrite=True``, see
    :func:`~.rewrite.rewrite_moe_modules`). Every layer is validated before anything is changed or
    communicated. Then each layer keeps ``E/ep`` experts per rank (DTensor ``Shard(0)``) and
    dispatches tokens with all-to-alls; its routers all-reduce their statistics over ``stats_groups``.
    Run it before tensor-parallel planning (the rewrite removes the ``experts.{i}.w1`` Linears).

    Data parallelism afterwards: wrap each ``moe.experts`` (a :class:`~.experts.GroupedExperts`) with
    FSDP2 / replicate over ``mesh["edp"]`` *before* wrapping the enclosing block over ``dp``, so that
    experts are averaged over ``edp`` and router / shared experts over ``dp``
    (``fully_shard(moe.experts, mesh=mesh["edp"]); fully_shard(block, mesh=mesh["dp"])``).

    Args:
        model: the model (or one MoE layer).
        mesh: a :class:`~lightning_4d.mesh.FourDMesh` (preferred: defaults follow from its dims) or a
            1-D ep :class:`DeviceMesh` (then each rank's tokens are taken to be its own data shard).
        grad_scale: expert gradient factor; default :func:`expert_grad_scale` for a FourDMesh, else ``1/ep``.
        stats_groups: ``[(label, group)]`` covering the ranks that hold one batch's tokens; default the
            ``ep`` and ``edp`` groups of the stage (FourDMesh) or the ep group alone.
        aux_grad_scale: number of replicas dense gradients are averaged over; default ``dp`` (FourDMesh)
            or ``ep``.

    Example:
        >>> # not run: needs a process group
        >>> mesh = build_mesh(ParallelDims.from_world(4, tp=2, ep=2), "cpu")  # doctest: +SKIP
        >>> model = apply_expert_parallel(model, mesh)  # doctest: +SKIP
    """
    from lightning_4d.expert_parallel.rewrite import find_moe_modules, rewrite_moe_modules

    dims = getattr(mesh, "dims", None)
    ep_mesh = mesh[Axis.EP] if dims is not None else mesh
    ep = ep_mesh.size()
    # 1) validate everything first: no collective, no change before all layers are known to be fine.
    for name, mod in find_moe_modules(model):
        if isinstance(mod, MoE):
            check_expert_parallel(mod.num_experts, mod.top_k, ep, name or type(mod).__name__)
        else:
            num = len(mod.experts)
            k = getattr(mod, "top_k", getattr(mod, "num_experts_per_tok", 1))
            check_expert_parallel(num, k, ep, name or type(mod).__name__)
    if rewrite:
        model = rewrite_moe_modules(model)
    if dims is not None:
        grad_scale = expert_grad_scale(dims) if grad_scale is None else grad_scale
        if stats_groups is None:
            stats_groups = [(n, mesh[n].get_group()) for n in ("ep", "edp") if mesh[n].size() > 1]
        aux_grad_scale = float(dims.dp) if aux_grad_scale is None else aux_grad_scale
    else:
        grad_scale = 1.0 / ep if grad_scale is None else grad_scale
        if stats_groups is None:
            stats_groups = [("ep", ep_mesh.get_group())] if ep > 1 else []
        aux_grad_scale = float(ep) if aux_grad_scale is None else aux_grad_scale
    for mod in model.modules():
        if isinstance(mod, MoE):
            mod.shard_experts(ep_mesh, grad_scale=grad_scale)
            mod.router.stats_groups = list(stats_groups)
            mod.router.aux_grad_scale = aux_grad_scale
    return model


def apply_inplace_expert_parallel(model: nn.Module, ep_mesh: Optional["DeviceMesh"], grad_scale: float = 1.0,
                                  ) -> list["ExpertsSpec"]:
    """Install in-place expert parallelism (:mod:`.inplace`) on every experts module of ``model`` with 3-D
    parameters (transformers 5, TorchTitan style) and return their specs. Everything is validated first, on
    every rank and before any change: an MoE-looking module that is not recognised raises when ``ep > 1``
    (listing each with the reason), as does an expert count ``ep`` does not divide or a forward that the
    one-process replay (:func:`~.inplace.verify_experts`) does not reproduce. At ``ep == 1`` nothing is sharded: an
    experts module the replay cannot split is left as written (not returned). Issues no collective.

    Example:
        >>> apply_inplace_expert_parallel(nn.Linear(2, 2), None)
        []
    """
    from lightning_4d.expert_parallel.inplace import (
        find_expert_modules, install_expert_parallel, is_inplace_experts, verify_experts,
    )

    ep = ep_mesh.size() if ep_mesh is not None else 1
    specs, rejected = find_expert_modules(model)
    if rejected and ep > 1:
        listed = "; ".join(f"'{name}': {why}" for name, why in rejected)
        raise ValueError(
            f"ep={ep}: {len(rejected)} module(s) of {type(model).__name__} look like mixture-of-experts weights "
            f"(parameters with 3+ dimensions) but were not recognised, so their experts cannot be sharded: "
            f"{listed}. Recognised: an experts module whose parameters are all [E, ...] (at least one 3-D), next to "
            f"a router holding an (E, hidden) weight (in its layer or the module around it), whose forward is one of "
            f"three contracts: forward(hidden_states, top_k_index, top_k_weights), the weighted sum over each "
            f"token's k experts (transformers); forward(x, num_tokens_per_expert), rows sorted by expert "
            f"(TorchTitan); or forward(x) of every-token experts (Llama 4; a module whose name contains 'expert'), which "
            f"assumes x is (E·N, hidden) expert-major with the router's scores already applied by the layer, and "
            f"that rows i·N to (i+1)·N go through expert i's weights alone, each row on its own (no sum or mixing "
            f"across rows or experts), so each block of rows can run on the rank holding its expert. The rewrite "
            f"replays that in one process at set-up and refuses a forward it does not reproduce. Fix: adapt the "
            f"module, or use lightning_4d.expert_parallel.MoE.")
    specs = [s for s in specs if not is_inplace_experts(model.get_submodule(s.name))]
    for spec in specs:
        check_expert_parallel(spec.num_experts, 1, ep, spec.name)
    verified = []
    for spec in specs:
        try:
            verify_experts(model.get_submodule(spec.name), spec, parts=max(ep, 2))
        except ValueError:
            if ep > 1:
                raise
            continue  # ep=1 shards no expert: a forward the replay cannot split runs as written (e.g. JetMoE)
        verified.append(spec)
    specs = verified
    for spec in specs:
        install_expert_parallel(model.get_submodule(spec.name), spec, ep_mesh if ep > 1 else None, grad_scale)
    return specs


def install_token_shard_check(layers: dict[str, nn.Module], tp_group: dist.ProcessGroup) -> None:
    """Check, on the first forward of each MoE layer, that the TP ranks of a data shard give it *different*
    tokens (sequence shards) — what expert parallelism with ``tp > 1`` assumes (each expert sums the
    contributions of every TP rank's tokens). A user TP plan that leaves the sequence whole into an MoE layer
    would otherwise route every token ``tp`` times and silently scale the expert gradients by ``tp``.
    Raises ``ValueError`` on every TP rank (the fingerprints are all-gathered, so all ranks decide alike);
    a DTensor input is rejected too. One small all-gather per layer, once.

    Example:
        >>> # not run: needs a process group
        >>> install_token_shard_check({"layers.1.feed_forward": moe}, mesh["tp"].get_group())  # doctest: +SKIP
    """
    import torch

    from lightning_4d.core.comm import internal_comm

    for name, layer in layers.items():
        handles: list[RemovableHandle] = []

        def check(mod: nn.Module, args: tuple, kwargs: dict, name: str = name, handles: list = handles) -> None:
            for h in handles:
                h.remove()
            x = args[0] if args else next(iter(kwargs.values()))
            if hasattr(x, "to_local"):
                raise ValueError(
                    f"MoE layer '{name}' receives a DTensor ({x.placements}); expert parallelism needs this rank's "
                    f"tokens as a plain tensor. Fix: in {hook_call(TP_PLAN)}, give it PrepareModuleInput(input_layouts="
                    f"(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True).")
            x64 = x.detach().double()  # the fingerprint stays on the tokens' device: the tp group's
            mine = torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device), x64.sum(),
                                x64.square().sum(), x64.reshape(-1)[: x.shape[-1]].abs().sum()])
            size = dist.get_world_size(tp_group)
            every = [torch.empty_like(mine) for _ in range(size)]
            with internal_comm():
                dist.all_gather(every, mine, group=tp_group)
            if all(torch.equal(e, every[0]) for e in every):
                raise ValueError(
                    f"MoE layer '{name}' sees the same tokens ({tuple(x.shape)}) on all {size} TP ranks: the tensor-"
                    f"parallel plan ({hook_call(TP_PLAN)}) does not split the sequence before it, so under ep>1 every "
                    f"token would be routed {size} times and the expert gradients scaled by {size}. Fix: shard the "
                    f"sequence into the MoE layer (SequenceParallel() on the norm before it and PrepareModuleInput("
                    f"input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True) on the "
                    f"layer), drop {hook_call(TP_PLAN)} to use the automatic plan, or use ep=1.")

        handles.append(layer.register_forward_pre_hook(check, with_kwargs=True))
