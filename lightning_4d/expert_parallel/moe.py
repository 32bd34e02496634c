"""Mixture-of-experts layer with stacked SwiGLU experts and optional expert parallelism.

``MoE`` maps ``(B, T, H) -> (B, T, H)`` (any leading shape): route every token to ``k`` experts
(``router``, a :class:`~.router.TopKRouter`), sort the assignments by expert (:mod:`.permute`), run
the experts (``experts``, a :class:`~.experts.GroupedExperts` with stacked weights ``w1 [E, F, H]``,
``w2 [E, H, F]``, ``w3 [E, F, H]``) as a grouped matmul, and sum the weighted outputs back per token;
optional ``shared_experts`` (a dense SwiGLU) are added to the output.

After :meth:`MoE.shard_experts` the layer keeps ``E/ep`` experts per rank as DTensors ``Shard(0)`` on
the ep mesh (global shape ``[E, F, H]`` for checkpoints; the forward uses ``.to_local()``), and sends
the tokens to their experts' ranks with all-to-alls (:mod:`.dispatch`). Routing is decided by each rank
for its own tokens (its data shard, or its sequence shard ``(B, T/tp, H)`` under sequence parallelism).

Aux loss. With ``aux_loss_coef > 0`` the router's aux loss is *attached* to the combine weights: the
forward value is unchanged, and the backward injects the aux gradient (like Megatron's
``MoEAuxLossAutoScaler``), so it reaches the router even inside a pipeline stage without touching
the training loss. The value (without coefficient) is logged via ``moe.router.aux_loss`` /
:func:`moe_aux_loss`.

Example:
    >>> moe = MoE(dim=8, hidden_dim=16, num_experts=4, top_k=2, aux_loss_coef=0.01, shared_hidden_dim=16)
    >>> y = moe(torch.randn(2, 3, 8))
    >>> y.shape, int(moe.tokens_per_expert.sum())
    (torch.Size([2, 3, 8]), 12)
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_4d.expert_parallel.dispatch import combine, dispatch
from lightning_4d.expert_parallel.experts import GroupedExperts, GroupedMM, SwiGLU
from lightning_4d.expert_parallel.permute import FIXED_ROUTING, compute_capacity, make_permutation, permute, unpermute
from lightning_4d.expert_parallel.router import ScoreFunc, TopKRouter

__all__ = ["MoE", "attach_aux_loss", "moe_aux_loss", "update_expert_bias", "expert_load"]


class _AttachAux(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, aux):  # type: ignore[override]
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        shape, dtype, device = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


def attach_aux_loss(out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Return ``out`` unchanged (as a view); in the backward, ``aux`` receives gradient 1 (as if it were
    added to the loss) whenever ``out`` receives its gradient. Attach it to a tensor that always gets a
    gradient (the MoE layer uses the router weights, which every token's output depends on).

    Example:
        >>> w = torch.ones((), requires_grad=True)
        >>> y = attach_aux_loss(torch.ones(2, requires_grad=True) * 3, 5 * w)
        >>> y.sum().backward(); float(w.grad)
        5.0
    """
    return _AttachAux.apply(out, aux)


class MoE(nn.Module):
    """Token-choice mixture of SwiGLU experts (see the module docstring).

    Args:
        dim: hidden size ``H``.
        hidden_dim: expert hidden size ``F``.
        num_experts: ``E``; top_k: ``k``; score_func / renormalize / route_scale / aux_loss_coef /
            bias_update_rate: see :class:`~.router.TopKRouter`.
        capacity_factor: ``None`` (dropless, default) or the factor of the per-expert capacity
            ``ceil(cf · N·k / E)`` over this rank's ``N`` tokens; overflow assignments with the lowest
            scores are dropped (they contribute zero; the residual path carries the token).
        shared_hidden_dim: hidden size of the shared experts (a dense SwiGLU added to the output), or None.
        init_std / out_init_std: std of ``w1`` / (``w2``, ``w3``) and the router.
        grouped_mm: ``"auto"``, ``True`` or ``False`` (see :func:`~.experts.grouped_linear`).
        return_router_logits: return ``(out, logits (N, E))`` like Hugging Face's Mixtral block.

    Monitoring (last forward, this rank's tokens): ``tokens_per_expert`` ``(E,)`` assignments before
    dropping, ``dropped_tokens`` ``()``; ``router.aux_loss``.

    Example:
        >>> MoE(8, 16, num_experts=4, top_k=1, capacity_factor=1.0)(torch.randn(4, 5, 8)).shape
        torch.Size([4, 5, 8])
    """

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, top_k: int = 2, *,
        score_func: ScoreFunc = "softmax", renormalize: bool = True, route_scale: float = 1.0,
        aux_loss_coef: float = 0.0, bias_update_rate: float = 0.0, capacity_factor: Optional[float] = None,
        shared_hidden_dim: Optional[int] = None, init_std: float = 0.02, out_init_std: float = 0.02,
        grouped_mm: GroupedMM = "auto", return_router_logits: bool = False,
    ) -> None:
        super().__init__()
        self.router = TopKRouter(
            dim, num_experts, top_k, score_func=score_func, renormalize=renormalize, route_scale=route_scale,
            aux_loss_coef=aux_loss_coef, bias_update_rate=bias_update_rate, init_std=init_std)
        if capacity_factor is not None:
            compute_capacity(1, 1, capacity_factor)  # validates
        self.dim, self.hidden_dim, self.num_experts, self.top_k = dim, hidden_dim, num_experts, top_k
        self.capacity_factor = capacity_factor
        self.return_router_logits = return_router_logits
        self.init_std, self.out_init_std = init_std, out_init_std
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, init_std, out_init_std, grouped_mm)
        self.shared_experts = (
            SwiGLU(dim, shared_hidden_dim, init_std, out_init_std) if shared_hidden_dim else None)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros((), dtype=torch.long), persistent=False)
        # Expert parallelism (set by shard_experts): the ep group.
        self.ep_group: Optional[dist.ProcessGroup] = None
        self.source_key_map: dict[str, tuple[str, Optional[int]]] = {}  # filled by the Mixtral rewrite
        self.reset_parameters()

    @property
    def num_local_experts(self) -> int:
        """Experts held by this rank (``E / ep`` after :meth:`shard_experts`)."""
        return self.experts.num_local_experts

    def reset_parameters(self) -> None:
        """Re-initialise experts (first: DTensor random ops of the dense parts under FSDP may re-seed the
        global generator), router and shared experts."""
        self.experts.reset_parameters()
        self.router.reset_parameters()
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()
        self.tokens_per_expert.zero_()
        self.dropped_tokens.zero_()

    def shard_experts(self, ep_mesh: "torch.distributed.device_mesh.DeviceMesh", grad_scale: float = 1.0) -> None:
        """Keep experts ``[r·E/ep, (r+1)·E/ep)`` on ep rank ``r`` (DTensor ``Shard(0)``, see
        :meth:`~.experts.GroupedExperts.shard`) and route tokens through all-to-alls over ``ep_mesh``.
        ``grad_scale`` multiplies the expert gradients (see :func:`~.parallel.expert_grad_scale`).
        Issues no collective.

        Example:
            >>> # not run: needs a process group
            >>> moe.shard_experts(mesh["ep"], grad_scale=expert_grad_scale(dims))  # doctest: +SKIP
        """
        if ep_mesh.ndim != 1:
            raise ValueError(f"shard_experts needs a 1-D ep mesh, got {ep_mesh.ndim} dims {ep_mesh.mesh_dim_names}")
        self.experts.shard(ep_mesh)
        self.experts.grad_scale = grad_scale
        self.ep_group = ep_mesh.get_group() if ep_mesh.size() > 1 else None

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Route, dispatch, run the experts, combine. In a compiled block (``compile=...``) the layer runs eagerly,
        a graph break: its token dispatch keeps the expert mesh for backward, which AOTAutograd refuses."""
        if torch.compiler.is_compiling():
            return _eager_moe(self, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        shape = x.shape
        h = x.reshape(-1, shape[-1])  # (N, H)
        r = self.router(h)
        capacity = None
        if self.capacity_factor is not None:
            capacity = compute_capacity(h.shape[0] * self.top_k, self.num_experts, self.capacity_factor)
        fixed = FIXED_ROUTING.get()  # routing decided outside the router (the planner's dry run)
        if fixed is not None:
            plan = fixed.permutation(r.indices, self.num_experts, capacity)
        else:
            scores = r.scores.gather(-1, r.indices).detach()  # (N, k)
            plan = make_permutation(r.indices, self.num_experts, scores=scores, capacity=capacity)
        xs = permute(h, plan)  # (M, H) sorted by expert
        if self.ep_group is not None:
            recv, info = dispatch(xs, plan.tokens_per_expert, self.ep_group)  # (R, H)
            ys = combine(self.experts(recv, info.tokens_per_local_expert, info.host_tokens_per_local_expert),
                         info)  # (R, H) -> (M, H)
        else:
            ys = self.experts(xs, plan.tokens_per_expert)  # (M, H)
        weights = r.weights  # (N, k)
        if r.aux_loss is not None and torch.is_grad_enabled():
            weights = attach_aux_loss(weights, r.aux_loss)  # the weights always receive a gradient
        out = unpermute(ys, plan, weights, out_shape=shape)  # (B, T, H), not a view (FSDP-friendly)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        with torch.no_grad():
            self.tokens_per_expert.copy_(plan.routed_per_expert)
            self.dropped_tokens.copy_(plan.num_dropped)
        return (out, r.logits) if self.return_router_logits else out

    def extra_repr(self) -> str:
        ep = "" if self.ep_group is None else f", ep={dist.get_world_size(self.ep_group)}"
        return (f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, capacity_factor={self.capacity_factor}{ep}")


def _routers(model: nn.Module) -> list[TopKRouter]:
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def moe_aux_loss(model: nn.Module) -> Optional[torch.Tensor]:
    """Sum of the last forward's aux losses (detached, without coefficients) of every router in
    ``model``, for logging; ``None`` if no router computed one.

    Example:
        >>> m = MoE(8, 16, 4, 2, aux_loss_coef=0.01); _ = m(torch.randn(3, 8))
        >>> float(moe_aux_loss(m)) > 0
        True
    """
    vals = [r.aux_loss for r in _routers(model) if r.aux_loss is not None]
    return torch.stack(vals).sum() if vals else None


def update_expert_bias(model: nn.Module) -> None:
    """Call :meth:`~.router.TopKRouter.update_bias` on every router (after ``optimizer.step()``;
    collective over the routers' ``stats_groups``, so every rank must call it).

    Example:
        >>> update_expert_bias(MoE(8, 16, 4, 2, bias_update_rate=1e-3))
    """
    for r in _routers(model):
        if r.expert_bias is not None:
            r.update_bias()


def expert_load(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{module name: tokens_per_expert (E,)}`` of the last forward of every :class:`MoE` (this rank).

    Example:
        >>> m = MoE(8, 16, 4, 2); _ = m(torch.randn(3, 8)); int(expert_load(m)[""].sum())
        6
    """
    return {name: m.tokens_per_expert.clone() for name, m in model.named_modules() if isinstance(m, MoE)}


def _moe_forward(moe: MoE, x: torch.Tensor) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    return moe._forward(x)


_eager_moe = torch.compiler.disable(_moe_forward)
