"""Top-k token-choice router with an auxiliary load-balancing loss and aux-loss-free bias balancing.

Math (per token ``x``, ``E`` experts, ``k`` chosen):

- ``logits = gate(x)`` (a bias-free ``Linear(H, E)``) and ``scores = softmax(logits)`` or ``sigmoid(logits)``,
  both in fp32 whatever the precision (autocast off, as TorchTitan's and Megatron's fp32 routers): a bf16 logit's
  rounding would flip near-tied top-k choices between runs that differ only in summation order;
- selection: ``topk(scores + expert_bias, k)``, where ``expert_bias`` is a non-gradient buffer used for
  selection only (DeepSeek-V3's aux-loss-free balancing; zero unless ``bias_update_rate > 0``);
- weights: ``scores`` at the chosen experts, divided by their sum if ``renormalize``, times
  ``route_scale``, cast to ``x.dtype``. With softmax, no bias and ``renormalize=True`` this is exactly
  Mixtral's routing.
- aux loss (Switch / GShard): ``aux = E · Σ_e f_e · P_e`` with ``f_e = count_e / (N·k)`` (fraction of
  assignments) and ``P_e`` the mean over tokens of the (for sigmoid: sum-normalised) scores; 1 when
  perfectly balanced.

Distributed statistics. When the ranks of ``stats_groups`` hold different tokens of one batch (data and
sequence shards), ``count_e``, ``N`` and ``Σ P`` are all-reduced so the aux loss and the bias update are
those of the whole batch, as in a single process. The gradient of the aux loss with respect to this
rank's scores is then ``coef · aux_grad_scale · E · f_e / N_global`` per token; ``aux_grad_scale`` must be
the number of replicas over which dense gradients are *averaged* (``dp``), so that after the usual
reduction (sum over sequence shards, mean over dp) the router gradient equals the single-process one.

Example:
    >>> router = TopKRouter(dim=8, num_experts=4, top_k=2, aux_loss_coef=0.01)
    >>> out = router(torch.randn(5, 8))
    >>> out.indices.shape, out.weights.shape, out.scores.shape
    (torch.Size([5, 2]), torch.Size([5, 2]), torch.Size([5, 4]))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_4d.expert_parallel.dispatch import all_reduce_
from lightning_4d.expert_parallel.permute import expert_counts

__all__ = ["RouterOutput", "TopKRouter", "check_routing"]

ScoreFunc = Literal["softmax", "sigmoid"]


def check_routing(num_experts: int, top_k: int, score_func: str = "softmax") -> None:
    """Validate router settings (pure); raises ``ValueError`` naming value, rule and fix.

    Example:
        >>> check_routing(8, 2)
        >>> check_routing(2, 3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: top_k=3 exceeds num_experts=2: ... Use top_k <= 2 or add experts.
    """
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be a positive integer. Pass e.g. num_experts=8.")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k={top_k!r} must be a positive integer. Pass e.g. top_k=2.")
    if top_k > num_experts:
        raise ValueError(
            f"top_k={top_k} exceeds num_experts={num_experts}: a token cannot choose more distinct experts "
            f"than exist. Use top_k <= {num_experts} or add experts."
        )
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"score_func={score_func!r} is not supported: use 'softmax' or 'sigmoid'.")


@dataclass
class RouterOutput:
    """Routing decision for ``N`` tokens.

    Attributes:
        indices: ``(N, k)`` chosen experts (int64), best first.
        weights: ``(N, k)`` combine weights in the input dtype (differentiable).
        scores: ``(N, E)`` fp32 router scores (differentiable).
        logits: ``(N, E)`` gate outputs.
        aux_loss: differentiable local aux term whose gradient is the rank's share of the global aux
            loss gradient (already multiplied by ``aux_loss_coef · aux_grad_scale``), or ``None``.
    """

    indices: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor
    logits: torch.Tensor
    aux_loss: Optional[torch.Tensor] = None


class TopKRouter(nn.Module):
    """Token-choice top-k router (see the module docstring for the math).

    Args:
        dim: hidden size ``H``.
        num_experts: ``E``.
        top_k: experts per token ``k``.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        renormalize: divide the chosen ``k`` scores by their sum.
        route_scale: constant multiplier of the weights (DeepSeek's routed scaling factor).
        aux_loss_coef: coefficient of the aux loss (0 = off).
        bias_update_rate: step of the aux-loss-free bias update (0 = off; registers ``expert_bias``).
        init_std: std of the gate's normal initialisation.

    Attributes set by :func:`~lightning_4d.expert_parallel.parallel.apply_expert_parallel`:
        stats_groups: ``[(label, group), ...]`` whose union holds the batch's tokens; statistics are
            all-reduced over each in turn (empty: this rank's tokens are the whole batch).
        aux_grad_scale: see the module docstring (1 for a single process).
        aux_loss: the last forward's global aux loss value (detached, without the coefficient).

    Example:
        >>> r = TopKRouter(8, 4, 2, bias_update_rate=1e-3)
        >>> _ = r.train()(torch.randn(6, 8))
        >>> load = r.update_bias()   # after optimizer.step(); a collective over stats_groups
        >>> int(load.sum())
        12
    """

    def __init__(
        self, dim: int, num_experts: int, top_k: int, *, score_func: ScoreFunc = "softmax",
        renormalize: bool = True, route_scale: float = 1.0, aux_loss_coef: float = 0.0,
        bias_update_rate: float = 0.0, init_std: float = 0.02,
    ) -> None:
        super().__init__()
        check_routing(num_experts, top_k, score_func)
        if aux_loss_coef < 0 or bias_update_rate < 0:
            raise ValueError(
                f"aux_loss_coef={aux_loss_coef} and bias_update_rate={bias_update_rate} must be >= 0 (0 = off)."
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.renormalize, self.route_scale = score_func, renormalize, route_scale
        self.aux_loss_coef, self.bias_update_rate, self.init_std = aux_loss_coef, bias_update_rate, init_std
        self.gate = nn.Linear(dim, num_experts, bias=False)
        if bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))  # checkpointed
        else:
            self.expert_bias = None
        self.register_buffer("load_accum", torch.zeros(num_experts, dtype=torch.float64), persistent=False)
        self.stats_groups: list[tuple[str, dist.ProcessGroup]] = []
        self.aux_grad_scale = 1.0
        self.aux_loss: Optional[torch.Tensor] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) gate; zero bias and load accumulator."""
        nn.init.normal_(self.gate.weight, std=self.init_std)
        with torch.no_grad():
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.load_accum.zero_()

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        for _label, group in self.stats_groups:
            all_reduce_(t, group)
        return t

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Route ``x`` of shape ``(N, H)``."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())  # (N, E) fp32
        if self.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
        else:
            scores = torch.sigmoid(logits.float())  # (N, E)
        select = scores if self.expert_bias is None else scores.detach() + self.expert_bias  # (N, E)
        indices = torch.topk(select, self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, indices)  # (N, k)
        if self.renormalize:
            denom = weights.sum(dim=-1, keepdim=True)
            weights = weights / (denom + 1e-20 if self.score_func == "sigmoid" else denom)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        weights = weights.to(x.dtype)
        counts = expert_counts(indices, self.num_experts)  # (E,) on the device
        if self.training:
            with torch.no_grad():
                self.load_accum += counts.to(self.load_accum.dtype)
        aux = self._aux_loss(scores, counts, x.shape[0]) if self.aux_loss_coef > 0 and self.training else None
        return RouterOutput(indices, weights, scores, logits, aux)

    def _aux_loss(self, scores: torch.Tensor, counts: torch.Tensor, n: int) -> torch.Tensor:
        probs = scores if self.score_func == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
        prob_sum = probs.sum(0)  # (E,) differentiable, local tokens
        e = self.num_experts
        stats = torch.cat([counts.to(torch.float64), prob_sum.detach().to(torch.float64),
                           torch.full((1,), n, dtype=torch.float64, device=counts.device)])  # (2E+1,)
        stats = self._all_reduce(stats)
        g_counts, g_prob, g_n = stats[:e], stats[e:2 * e], stats[2 * e]
        f64 = g_counts / (g_n * self.top_k)  # (E,) global assignment fractions
        self.aux_loss = (e * (f64 * g_prob).sum() / g_n).float()
        f = f64.to(prob_sum.dtype)
        local = e * (f * prob_sum).sum() / g_n.to(prob_sum.dtype)  # rank's share; sums to the global aux
        return local * (self.aux_loss_coef * self.aux_grad_scale)

    @torch.no_grad()
    def update_bias(self) -> torch.Tensor:
        """Aux-loss-free balancing step: ``bias += rate · sign(mean_load - load)`` with the *global*
        load accumulated since the last call (all-reduced over ``stats_groups``: every rank of those
        groups must call it). Resets the accumulator; returns the global load ``(E,)``. Call it after
        ``optimizer.step()``; a no-op returning the load when ``bias_update_rate == 0``.

        Example:
            >>> r = TopKRouter(4, 2, 1, bias_update_rate=0.1).train()
            >>> _ = r(torch.randn(3, 4)); load = r.update_bias()   # 3 tokens: loads (2, 1) or (1, 2)
            >>> torch.allclose(r.expert_bias.abs(), torch.full((2,), 0.1))
            True
        """
        load = self._all_reduce(self.load_accum.clone())  # (E,)
        self.load_accum.zero_()
        if self.expert_bias is not None:
            self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load).to(self.expert_bias.dtype)
        return load

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, score_func={self.score_func}, "
                f"renormalize={self.renormalize}, aux_loss_coef={self.aux_loss_coef}, "
                f"bias_update_rate={self.bias_update_rate}")
