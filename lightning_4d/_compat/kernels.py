"""Private operators: ``torch._foreach_norm``, ``torch._foreach_mul_``, ``torch._grouped_mm`` (where the public
``torch.nn.functional.grouped_mm`` is missing), the SDPA kernels (also with their log-sum-exp, forward and backward:
:func:`attention_with_lse`).

Example:
    >>> import torch
    >>> [round(float(n), 4) for n in foreach_norm([torch.ones(4), torch.ones(1)], 2.0)]
    [2.0, 1.0]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from lightning_4d._compat.fake import is_fake

if TYPE_CHECKING:
    from torch._ops import OpOverload

__all__ = ["attention_ops", "attention_with_lse", "attention_with_lse_backward", "foreach_mul_", "foreach_norm",
           "fused_optimizer_devices", "grouped_mm", "grouped_mm_supported", "reducing_collective_ops"]


def foreach_norm(tensors: list[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """The ``ord``-norm of each tensor in one fused call (private ``torch._foreach_norm``; a loop of
    ``torch.linalg.vector_norm`` where it is missing)."""
    fused = getattr(torch, "_foreach_norm", None)
    if fused is not None:
        return list(fused(tensors, ord))
    return [torch.linalg.vector_norm(t, ord) for t in tensors]


def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-dim ``factor`` (on their device) in one fused call (private
    ``torch._foreach_mul_``; a loop of ``mul_`` where it is missing). The factor stays on the device: no host sync."""
    fused = getattr(torch, "_foreach_mul_", None)
    if fused is not None:
        fused(tensors, factor)
        return
    for t in tensors:
        t.mul_(factor)


def _grouped_mm_op() -> Optional[Callable[..., torch.Tensor]]:
    """``torch.nn.functional.grouped_mm`` (public since torch 2.10), else the private ``torch._grouped_mm``, else
    ``None``."""
    public = getattr(torch.nn.functional, "grouped_mm", None)
    return public if public is not None else getattr(torch, "_grouped_mm", None)


def fused_optimizer_devices() -> list[str]:
    """Device types with fused optimizer kernels (``fused=True``; private
    ``torch.utils._foreach_utils._get_fused_kernels_supported_devices``; ``["cuda", "cpu"]`` where it is missing)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return ["cuda", "cpu"]
    return list(_get_fused_kernels_supported_devices())


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor, dtype: Optional[torch.dtype] = None) -> bool:
    """Whether :func:`grouped_mm` runs ``x (M, K)`` against stacked ``w (G, N, K)`` here (both cast to ``dtype``
    first, when given): this torch has the operator, dtypes match, the last two dims of ``w`` are 16-byte
    multiples, and the device / dtype is one its kernels take (CPU fp32/bf16/fp16, CUDA bf16 on sm90+; fake or meta
    tensors, e.g. a planner dry run, bf16 only: the operator's meta kernel)."""
    x_dtype, w_dtype = (dtype, dtype) if dtype is not None else (x.dtype, w.dtype)
    if _grouped_mm_op() is None or x_dtype != w_dtype:
        return False
    if (is_fake(x) or x.is_meta) and x_dtype != torch.bfloat16:
        return False
    align = 16 // torch.empty((), dtype=x_dtype, device="meta").element_size()
    if w.shape[-1] % align or w.shape[-2] % align:
        return False
    if x.device.type == "cpu":
        return x_dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        return x_dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


def grouped_mm(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.grouped_mm(x (M, K), w_t (G, K, N), offs=offs (G,) int32 cumsum) -> (M, N)`` (the
    private ``torch._grouped_mm`` where the public name is missing). The offsets stay on the device: no host sync.

    Its backward rejects non-contiguous incoming gradients (e.g. from ``.sum()``), so the output
    gets a hook that makes the gradient contiguous. Check :func:`grouped_mm_supported` first.
    """
    op = _grouped_mm_op()
    assert op is not None, "grouped_mm: check grouped_mm_supported first"
    y = op(x, w_t, offs=offs)  # (M, N)
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


def _lse_kernel(query: torch.Tensor) -> str:
    """Which fused kernel :func:`attention_with_lse` runs for ``query``: ``"cpu"`` (private
    ``aten._scaled_dot_product_flash_attention_for_cpu``), ``"cuda"`` (private
    ``aten._scaled_dot_product_efficient_attention``), else ``"math"`` (public ops on the piece)."""
    if is_fake(query) or query.is_meta:
        return "math"
    if query.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return "cpu" if query.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16) else "math"
    if query.device.type == "cuda" and hasattr(torch.ops.aten, "_scaled_dot_product_efficient_attention"):
        return "cuda" if query.dtype in (torch.float32, torch.bfloat16, torch.float16) else "math"
    return "math"


def _lse_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def _aligned_bias(bias: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The memory-efficient kernel's bias: ``(B, H, Tq, Tk)``, its rows 16-element aligned (padded, then viewed)."""
    shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    pad = (-key.shape[2]) % 16
    if pad:
        bias = torch.nn.functional.pad(bias, (0, pad))[..., : key.shape[2]]
    return bias.expand(shape)


def _math_scores(query: torch.Tensor, key: torch.Tensor, is_causal: bool, mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    acc = _lse_dtype(query)
    scores = (query.to(acc) @ key.to(acc).transpose(-1, -2)) * scale  # (B, H, Tq, Tk)
    if mask is not None:
        scores = scores + mask.to(acc)
    if is_causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = False,
                       mask: torch.Tensor | None = None, scale: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query (B, H, Tq, E)`` over ``key`` / ``value (B, H, Tk, E|Ev)`` and the log-sum-exp of each
    query's scores: ``(out (B, H, Tq, Ev), lse (B, H, Tq) fp32)``. ``mask``: additive, ``(1 or B, 1 or H, Tq, Tk)``
    in the query's dtype; ``is_causal``: top-left causal; ``lse`` fp32 (fp64 for fp64 queries). No autograd (:func:`attention_with_lse_backward` is the
    backward). Fused kernels where torch has them (private ``aten._scaled_dot_product_flash_attention_for_cpu`` on
    the CPU, ``aten._scaled_dot_product_efficient_attention`` on CUDA), else public ops on the piece.

    Example:
        >>> q = torch.randn(1, 2, 3, 4)
        >>> out, lse = attention_with_lse(q, q, q, is_causal=True)
        >>> bool(torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True),
        ...                     atol=1e-6)), tuple(lse.shape)
        (True, (1, 2, 3))
    """
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    kernel = _lse_kernel(query)
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale)
        return out, lse.to(_lse_dtype(query))
    if kernel == "cuda":
        bias = None if mask is None else _aligned_bias(mask, query, key)
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, 0.0, is_causal, scale=scale)
        return out, lse[..., : query.shape[2]].float()  # the kernel may pad the lse to 32 queries
    scores = _math_scores(query, key, is_causal, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Tq)
    out = (torch.exp(scores - lse[..., None]).nan_to_num(0.0) @ value.to(scores.dtype)).to(query.dtype)
    return out, lse


def attention_with_lse_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, is_causal: bool = False,
                                mask: torch.Tensor | None = None, scale: float | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`attention_with_lse` for ``grad`` on ``out``, given ``out`` and
    ``lse``; with the output and log-sum-exp of attention over *more* keys (several pieces merged) it gives this
    piece's share of that attention's gradients (the flash-attention backward), which sum to the whole.

    Example:
        >>> q = torch.randn(1, 1, 3, 4, requires_grad=True)
        >>> out, lse = attention_with_lse(q.detach(), q.detach(), q.detach())
        >>> dq, dk, dv = attention_with_lse_backward(torch.ones_like(out), q.detach(), q.detach(), q.detach(),
        ...                                          out, lse)
        >>> torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
        >>> bool(torch.allclose(dq + dk + dv, q.grad, atol=1e-5))
        True
    """
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    kernel = _lse_kernel(query)
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), query, key, value, out, lse.to(_lse_dtype(query)), 0.0, is_causal, attn_mask=mask,
            scale=scale)
    if kernel == "cuda":
        bias = None if mask is None else _aligned_bias(mask, query, key)
        seed = torch.zeros((), dtype=torch.int64, device=query.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad.contiguous(), query, key, value, bias, out, lse.contiguous(), seed, seed, 0.0,
            [True, True, True, False], is_causal, scale=scale)
        return dq, dk, dv
    scores = _math_scores(query, key, is_causal, mask, scale)
    acc = scores.dtype
    probs = torch.exp(scores - lse[..., None].to(acc)).nan_to_num(0.0)  # (B, H, Tq, Tk)
    g = grad.to(acc)
    dv = probs.transpose(-1, -2) @ g  # (B, H, Tk, Ev)
    dp = g @ value.to(acc).transpose(-1, -2)
    ds = probs * (dp - (g * out.to(acc)).sum(-1, keepdim=True)) * scale
    return (ds @ key.to(acc)).to(query.dtype), (ds.transpose(-1, -2) @ query.to(acc)).to(key.dtype), \
        dv.to(value.dtype)
