"""Private operators: ``torch._foreach_norm``, ``torch._grouped_mm``, the SDPA kernels.

Example:
    >>> import torch
    >>> [round(float(n), 4) for n in foreach_norm([torch.ones(4), torch.ones(1)], 2.0)]
    [2.0, 1.0]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lightning_4d._compat.fake import is_fake

if TYPE_CHECKING:
    from torch._ops import OpOverload

__all__ = ["attention_ops", "foreach_norm", "grouped_mm", "grouped_mm_supported", "reducing_collective_ops"]


def foreach_norm(tensors: list[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """The ``ord``-norm of each tensor in one fused call (private ``torch._foreach_norm``; a loop of
    ``torch.linalg.vector_norm`` where it is missing)."""
    fused = getattr(torch, "_foreach_norm", None)
    if fused is not None:
        return list(fused(tensors, ord))
    return [torch.linalg.vector_norm(t, ord) for t in tensors]


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`grouped_mm` runs ``x (M, K)`` against stacked ``w (G, N, K)`` here: this torch has
    the private ``torch._grouped_mm``, dtypes match, the last two dims of ``w`` are 16-byte multiples,
    and the device / dtype is one its kernels take (CPU fp32/bf16/fp16, CUDA bf16 on sm90+; fake or meta
    tensors, e.g. a planner dry run, bf16 only: the operator's meta kernel)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    if (is_fake(x) or x.is_meta) and x.dtype != torch.bfloat16:
        return False
    align = 16 // x.element_size()
    if w.shape[-1] % align or w.shape[-2] % align:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


def grouped_mm(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Private ``torch._grouped_mm(x (M, K), w_t (G, K, N), offs (G,) int32 cumsum) -> (M, N)``.

    Its backward rejects non-contiguous incoming gradients (e.g. from ``.sum()``), so the output
    gets a hook that makes the gradient contiguous. Check :func:`grouped_mm_supported` first.
    """
    y = torch._grouped_mm(x, w_t, offs=offs)  # (M, N)
    if y.requires_grad:
        y.register_hook(lambda g: g.contiguous())
    return y


def _default_overloads(namespace: Any, names: tuple[str, ...]) -> set[OpOverload]:
    """``namespace.<name>.default`` of each of ``names`` that this torch has."""
    ops = set()
    for name in names:
        packet = getattr(namespace, name, None)
        overload = getattr(packet, "default", None) if packet is not None else None
        if overload is not None:
            ops.add(overload)
    return ops


def attention_ops() -> set[OpOverload]:
    """The private fused attention kernels ``F.scaled_dot_product_attention`` dispatches to
    (``aten._scaled_dot_product_{flash_attention_for_cpu,efficient_attention,flash_attention,cudnn_attention}
    .default``; cuDNN's is what torch picks first on an H100), those this torch has."""
    return _default_overloads(torch.ops.aten, (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention"))


def reducing_collective_ops() -> set[OpOverload]:
    """The private functional collectives whose output is no larger than their input in total
    (``_c10d_functional.{all_reduce,reduce_scatter_tensor,all_to_all_single}.default``, those this torch has): what
    DTensor's tensor / sequence parallelism runs after a row-parallel matmul. The all-gather (its output ``n`` times
    its input) is left out, as in TorchTitan's selective policy."""
    return _default_overloads(getattr(torch.ops, "_c10d_functional", None),
                              ("all_reduce", "reduce_scatter_tensor", "all_to_all_single"))
