"""What kind of layer a module is: linear, norm, and the three meanings of "a mixture-of-experts module".

Each predicate is defined here once and imported by every room that asks (the trace, the tensor-parallel plan,
the expert rewrites); this module imports nothing of the package, so any room may import it.

The three MoE meanings are different questions, and each has its own name:

- :func:`holds_routed_experts` — *a mixture-of-experts layer* (router + experts, any style): it has an ``experts``
  child, or is a class named ``MoE`` / ``MoELayer``. The trace makes such layers opaque on the meta device and the
  tensor-parallel plan leaves them to expert parallelism.
- :func:`is_expert_list` — *an MoE layer whose experts are an ``nn.ModuleList`` of MLPs beside a ``gate``*
  (Mixtral style, one module per expert): what :func:`~lightning_4d.expert_parallel.rewrite.rewrite_moe_modules`
  converts into the package's own layer.
- :func:`holds_stacked_experts` — *an experts module holding stacked ``[E, ...]`` tensors* (transformers 5,
  TorchTitan): a direct parameter with 3 or more dimensions outside a convolution; what
  :func:`~lightning_4d.expert_parallel.inplace.find_expert_modules` inspects for in-place expert parallelism.

Example:
    >>> from torch import nn
    >>> class Mixtral(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gate = nn.Linear(8, 2, bias=False)
    ...         self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
    >>> layer = Mixtral()
    >>> holds_routed_experts(layer), is_expert_list(layer), holds_stacked_experts(layer)
    (True, True, False)
    >>> is_linear(layer.gate), is_norm(nn.LayerNorm(8)), is_norm(layer.gate)
    (True, True, False)
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["holds_routed_experts", "holds_stacked_experts", "is_conv1d", "is_expert_list", "is_linear", "is_norm"]

_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D``: ``y = x @ weight + bias`` with ``weight`` of shape ``[in, out]``.

    Example:
        >>> is_conv1d(nn.Linear(2, 3))
        False
    """
    w = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2
            and hasattr(module, "nf"))


def is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` or a transformers ``Conv1D``.

    Example:
        >>> is_linear(nn.Linear(2, 3)), is_linear(nn.Embedding(2, 3))
        (True, False)
    """
    return isinstance(module, nn.Linear) or is_conv1d(module)


def is_norm(module: nn.Module) -> bool:
    """LayerNorm / RMSNorm, or a user class whose name ends in ``Norm`` (or ``NormGated``: a state-space mixer's
    gated RMSNorm) and holds no modules (DBRX's ``DbrxNormAttentionNorm`` holds two norms and the attention: a
    container, not a norm).

    Example:
        >>> is_norm(nn.RMSNorm(4)), is_norm(nn.Linear(4, 4))
        (True, False)
        >>> class NormAttentionNorm(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.norm_1, self.attn = nn.LayerNorm(4), nn.Linear(4, 4)
        >>> is_norm(NormAttentionNorm())
        False
    """
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return True
    return type(module).__name__.endswith(("Norm", "NormGated")) and next(module.children(), None) is None


def holds_routed_experts(module: nn.Module) -> bool:
    """A mixture-of-experts layer of any style: it has an ``experts`` attribute (Mixtral, transformers 5, the
    package's :class:`~lightning_4d.expert_parallel.MoE`) or its class is named ``MoE`` / ``MoELayer``.

    Example:
        >>> holds_routed_experts(nn.Linear(2, 2))
        False
    """
    return hasattr(module, "experts") or type(module).__name__ in ("MoE", "MoELayer")


def is_expert_list(module: nn.Module) -> bool:
    """A Mixtral-style MoE layer: an ``experts`` ``nn.ModuleList`` (one MLP per expert) beside a ``gate`` module.
    The package's own MoE (a ``router`` and grouped experts) is not one.

    Example:
        >>> is_expert_list(nn.Linear(2, 2))
        False
    """
    return (isinstance(getattr(module, "experts", None), nn.ModuleList)
            and isinstance(getattr(module, "gate", None), nn.Module))


def holds_stacked_experts(module: nn.Module) -> bool:
    """A module holding a direct parameter with 3 or more dimensions (the stacked ``[E, ...]`` tensors of an experts
    module), convolutions (whose kernels are 3-D and more) excepted, as is a broadcast shape with a leading 1
    (Kimi-Linear's per-head ``A_log`` of shape ``(1, 1, heads, 1)``: no stack of experts).

    Example:
        >>> holds_stacked_experts(nn.Conv2d(1, 1, 3)), holds_stacked_experts(nn.Linear(2, 2))
        (False, False)
    """
    if isinstance(module, _CONVOLUTIONS):
        return False
    return any(p.dim() >= 3 and p.shape[0] > 1 for p in module.parameters(recurse=False))
