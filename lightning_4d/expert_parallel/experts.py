"""Expert computation on stacked weights: grouped matmul, SwiGLU experts, gradient scaling, init.

:class:`GroupedExperts` owns the stacked weights, so a data-parallel wrapper can treat the experts
(replicated over ``edp``) apart from the dense router and shared experts (replicated over ``dp``).

Experts are stored stacked, ``w1 [E, F, H]``, ``w2 [E, H, F]``, ``w3 [E, F, H]``; the rows for expert
``e`` are contiguous (``counts[e]`` of them). torch's grouped matmul (``torch.nn.functional.grouped_mm``, through
:func:`lightning_4d._compat.grouped_mm`) runs all experts in one kernel where it is available (CPU
fp32/bf16/fp16, CUDA bf16 on sm90+, rows of 16-byte multiples), in autocast's dtype under autocast (the fp32
weights cast like an ``nn.Linear``'s); otherwise a per-expert loop gives the same math, with one copy of the
counts to the host per layer.

Example:
    >>> x = torch.randn(5, 8)                              # (M, H) sorted by expert
    >>> w1, w3 = torch.randn(2, 16, 8), torch.randn(2, 16, 8)
    >>> w2 = torch.randn(2, 8, 16)
    >>> swiglu_experts(x, w1, w2, w3, torch.tensor([3, 2])).shape
    torch.Size([5, 8])
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d import _compat
from lightning_4d.core.distributed import local_of

__all__ = ["GroupedExperts", "compute_dtype", "grouped_linear", "swiglu_experts", "scale_grad", "SwiGLU", "init_experts_",
           "GroupedMM"]

GroupedMM = Union[bool, Literal["auto"]]


def compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype expert matmuls run in: autocast's for ``x``'s device when autocast is on there (what ``F.linear``
    would run in), else ``x``'s when ``x`` and ``w`` agree, else the wider of the two.

    Example:
        >>> compute_dtype(torch.ones(1), torch.ones(1))
        torch.float32
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     compute_dtype(torch.ones(1), torch.ones(1))
        torch.bfloat16
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(x.dtype, w.dtype)


def grouped_linear(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, grouped_mm: GroupedMM = "auto",
    host_counts: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Per-expert ``x_e @ w[e].T`` for contiguous row groups: ``(M, in), (G, out, in) -> (M, out)``.

    ``x`` and ``w`` are cast to :func:`compute_dtype` (autocast's dtype under autocast: the experts' fp32 weights
    then run in bf16 like every ``nn.Linear``). One grouped matmul (:func:`lightning_4d._compat.grouped_mm`, reading
    ``counts`` on the device) where the operator takes these dtypes and shapes; a loop over the experts otherwise,
    which needs the counts on the host (``host_counts``, or one copy of ``counts``: a host sync on a GPU).

    Args:
        x: ``(M, in)`` rows, ``counts[e]`` rows of group ``e`` after those of ``e-1``.
        w: ``(G, out, in)`` stacked weights (``nn.Linear`` layout).
        counts: ``(G,)`` rows per group, summing to ``M``.
        grouped_mm: ``"auto"`` (the grouped matmul when supported), ``True`` (force), ``False`` (loop).
        host_counts: ``counts`` already on the host (e.g. :attr:`~.dispatch.DispatchInfo.host_tokens_per_local_expert`).

    Example:
        >>> grouped_linear(torch.ones(3, 4), torch.ones(2, 5, 4), torch.tensor([1, 2])).shape
        torch.Size([3, 5])
    """
    dtype = compute_dtype(x, w)
    x, w = x.to(dtype), w.to(dtype)
    use = _compat.grouped_mm_supported(x, w) if grouped_mm == "auto" else bool(grouped_mm)
    if use:
        offs = torch.cumsum(counts, 0).to(torch.int32)  # (G,)
        return _compat.grouped_mm(x.contiguous(), w.transpose(-2, -1), offs)  # (M, out)
    sizes = list(host_counts) if host_counts is not None else counts.tolist()
    chunks = x.split(sizes, dim=0)
    outs = [F.linear(c, w[e]) for e, c in enumerate(chunks)]  # [(m_e, out)]
    if not outs:
        return x.new_zeros(0, w.shape[-2])
    return torch.cat(outs, dim=0)  # (M, out)


def swiglu_experts(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor,
    grouped_mm: GroupedMM = "auto", host_counts: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """SwiGLU experts ``w2[e](silu(w1[e] x) * w3[e] x)`` on expert-sorted rows ``(M, H) -> (M, H)``, in
    :func:`compute_dtype`. The counts reach the host at most once (only for the loop; ``host_counts`` if known).

    Example:
        >>> swiglu_experts(torch.ones(2, 4), torch.ones(1, 8, 4), torch.ones(1, 4, 8), torch.ones(1, 8, 4),
        ...                torch.tensor([2])).shape
        torch.Size([2, 4])
    """
    if host_counts is None and not _grouped(x, w1, w2, grouped_mm):
        host_counts = counts.tolist()  # the loop's one copy for all three matmuls
    h = F.silu(grouped_linear(x, w1, counts, grouped_mm, host_counts)) * \
        grouped_linear(x, w3, counts, grouped_mm, host_counts)  # (M, F)
    return grouped_linear(h, w2, counts, grouped_mm, host_counts)  # (M, H)


def _grouped(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, grouped_mm: GroupedMM) -> bool:
    """Whether every matmul of :func:`swiglu_experts` runs grouped (no host counts needed)."""
    if grouped_mm != "auto":
        return bool(grouped_mm)
    dtype = compute_dtype(x, w_in)
    return _compat.grouped_mm_supported(x, w_in, dtype) and _compat.grouped_mm_supported(x, w_out, dtype)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity in the forward; multiplies the gradient by ``scale`` in the backward.

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> scale_grad(w, 0.5).sum().backward(); w.grad.tolist()
        [0.5, 0.5]
    """
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP ``w2(silu(w1 x) * w3 x)`` without bias (shared experts); names as Llama's.

    Example:
        >>> SwiGLU(8, 16)(torch.randn(3, 8)).shape
        torch.Size([3, 8])
    """

    def __init__(self, dim: int, hidden_dim: int, init_std: float = 0.02, out_init_std: float = 0.02) -> None:
        super().__init__()
        self.init_std, self.out_init_std = init_std, out_init_std
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for ``w1``; Normal(0, out_init_std) for ``w2`` and ``w3``."""
        nn.init.normal_(self.w1.weight, std=self.init_std)
        nn.init.normal_(self.w2.weight, std=self.out_init_std)
        nn.init.normal_(self.w3.weight, std=self.out_init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (..., F) -> (..., H)


@torch.no_grad()
def init_experts_(local: torch.Tensor, std: float, seed: int, first_expert: int) -> None:
    """Fill stacked expert weights with Normal(0, std), expert ``e`` from its own generator seeded
    ``seed + e`` (``e`` the *global* expert id), so the values do not depend on how experts are
    sharded. ``local`` holds experts ``[first_expert, first_expert + local.shape[0])``. No-op on meta.

    Example:
        >>> full = torch.empty(4, 2, 3); init_experts_(full, 0.02, seed=7, first_expert=0)
        >>> part = torch.empty(2, 2, 3); init_experts_(part, 0.02, seed=7, first_expert=2)
        >>> torch.equal(full[2:], part)
        True
    """
    if local.is_meta:
        return
    gen = torch.Generator(device=local.device)
    for i in range(local.shape[0]):
        gen.manual_seed(seed + first_expert + i)
        local[i].normal_(0.0, std, generator=gen)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (differentiable), or ``p`` itself (:func:`lightning_4d.core.distributed.local_of`)."""
    return local_of(p)


def first_local_expert(p: torch.Tensor) -> int:
    """Global index of the first expert (dim 0) held locally by ``p`` (plain tensor: 0); works for
    any DTensor layout, e.g. ep ``Shard(0)`` further sharded by FSDP over ``edp``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return 0
    return _compat.shard_global_offset(p)[0]


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts stored stacked: ``w1 [E, F, H]``, ``w2 [E, H, F]``, ``w3 [E, F, H]``.

    After :meth:`shard` each rank keeps ``E/ep`` experts as DTensors ``Shard(0)`` on the ep mesh
    (global shape kept for checkpoints); the forward runs on the local experts. ``grad_scale``
    multiplies the weight gradients (see :func:`~.parallel.expert_grad_scale`).

    Example:
        >>> ex = GroupedExperts(8, 16, num_experts=2)
        >>> ex(torch.randn(5, 8), torch.tensor([3, 2])).shape      # rows sorted by expert
        torch.Size([5, 8])
    """

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, init_std: float = 0.02, out_init_std: float = 0.02,
        grouped_mm: GroupedMM = "auto",
    ) -> None:
        super().__init__()
        self.num_experts, self.init_std, self.out_init_std = num_experts, init_std, out_init_std
        self.grouped_mm = grouped_mm
        self.grad_scale = 1.0
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # (E, F, H)
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))  # (E, H, F)
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # (E, F, H)
        self.reset_parameters()

    @property
    def num_local_experts(self) -> int:
        """Experts held by this rank."""
        return local_tensor(self.w1).shape[0]

    @property
    def first_expert(self) -> int:
        """Global index of this rank's first expert."""
        return first_local_expert(self.w1.data)

    def reset_parameters(self) -> None:
        """Normal(0, init_std) ``w1``, Normal(0, out_init_std) ``w2``/``w3``; expert ``e`` from a generator
        seeded by a draw of the global RNG plus ``e``, so values do not depend on the sharding."""
        seeds = torch.randint(0, 2**62, (3,), device="cpu").tolist()  # same draws on every rank and layout
        for p, std, seed in ((self.w1, self.init_std, seeds[0]), (self.w2, self.out_init_std, seeds[1]),
                             (self.w3, self.out_init_std, seeds[2])):
            init_experts_(local_tensor(p.data), std, seed, first_local_expert(p.data))

    def shard(self, ep_mesh: "torch.distributed.device_mesh.DeviceMesh") -> None:
        """Keep experts ``[r·E/ep, (r+1)·E/ep)`` on ep rank ``r`` as DTensors ``Shard(0)``. No collective.

        Example:
            >>> # not run: needs a process group
            >>> experts.shard(mesh["ep"])  # doctest: +SKIP
        """
        from torch.distributed.tensor import DTensor, Shard

        ep = ep_mesh.size()
        if isinstance(self.w1.data, DTensor):
            raise ValueError("these experts are already sharded (w1 is a DTensor)")
        if self.num_experts % ep:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by ep={ep}: every ep rank must hold the same "
                f"number of experts. Choose ep among the divisors of {self.num_experts} or change num_experts.")
        n_local = self.num_experts // ep
        first = ep_mesh.get_local_rank() * n_local
        for name in ("w1", "w2", "w3"):
            p = getattr(self, name)
            local = p.detach()[first:first + n_local].clone()
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(self, name, nn.Parameter(dt, requires_grad=p.requires_grad))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, host_counts: Optional[Sequence[int]] = None
                ) -> torch.Tensor:
        """``x (M, H)`` sorted by local expert, ``counts (E_local,)`` -> ``(M, H)``; ``host_counts``: ``counts`` on
        the host when known (see :func:`swiglu_experts`). In a compiled block they run eagerly (a graph break:
        Dynamo cannot trace their expert-parallel DTensor weights, "as_strided not supported with DTensor")."""
        if torch.compiler.is_compiling():
            return _eager_experts(self, x, counts, host_counts)
        return _experts(self, x, counts, host_counts)

    def extra_repr(self) -> str:
        e, f, h = self.w1.shape
        return f"num_experts={e}, hidden_dim={f}, dim={h}, local={self.num_local_experts}"


def _experts(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor,
             host_counts: Optional[Sequence[int]]) -> torch.Tensor:
    w1, w2, w3 = (scale_grad(local_tensor(p), experts.grad_scale) for p in (experts.w1, experts.w2, experts.w3))
    return swiglu_experts(x, w1, w2, w3, counts, experts.grouped_mm, host_counts)  # (M, H)


_eager_experts = torch.compiler.disable(_experts)
