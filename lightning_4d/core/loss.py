"""The global-batch loss: token-weighted across data-parallel ranks, equal on every rank.

Each rank computes the user's mean loss ``L_r`` over its ``n_r`` valid targets. The reported
value is ``Σ n_r L_r / Σ n_r``. Data parallelism averages gradients over the ``dp`` ranks, so
the loss used for backward is ``L_r · dp · n_r / N``: its averaged gradient is exactly the
gradient of the global mean, even when ranks hold different numbers of valid tokens.

Example:
    >>> import torch
    >>> count_targets(torch.tensor([[1, -100, 3]]), ignore_index=-100).item()
    2.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import Tensor

from lightning_4d.core.distributed import all_reduce_sum

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["check_inputs", "check_targets", "count_targets", "token_weighted", "weighted_global_loss", "with_value"]


def check_targets(targets: Any, loss_parallel: bool) -> None:
    """Refuse, before the step's first collective, targets the vocabulary-parallel cross-entropy cannot take.

    Example:
        >>> check_targets(torch.zeros(2, 3, dtype=torch.long), loss_parallel=True)
        >>> check_targets(torch.zeros(2, 3), loss_parallel=True)
        Traceback (most recent call last):
        ...
        ValueError: targets of dtype torch.float32: ...
    """
    if loss_parallel and isinstance(targets, Tensor) and targets.is_floating_point():
        raise ValueError(
            f"targets of dtype {targets.dtype}: with tp > 1 the output head over the vocabulary is sharded and "
            f"the loss is a vocabulary-parallel cross-entropy, which takes integer class indices. Pass class "
            f"indices (torch.long), or set tp=1 for soft (probability) targets."
        )


def check_inputs(inputs: Any, example_shape: Optional[tuple[int, ...]]) -> None:
    """Refuse, before the step's first collective, inputs whose rank differs from the input the model was set up
    (traced) with: tensor and pipeline parallelism cut inputs along the batch (micro-batches) and the sequence
    (sequence parallelism), so an unbatched ``(T,)`` sample would be cut along the wrong dimension.

    Example:
        >>> check_inputs(torch.zeros(2, 8, dtype=torch.long), (2, 8))
        >>> check_inputs(torch.zeros(8, dtype=torch.long), (2, 8))
        Traceback (most recent call last):
        ...
        ValueError: inputs of shape (8,) have 1 dimension(s), but the model was set up with inputs of 2 (2, 8): ...
    """
    if example_shape is None or not isinstance(inputs, Tensor) or inputs.dim() == len(example_shape):
        return
    raise ValueError(
        f"inputs of shape {tuple(inputs.shape)} have {inputs.dim()} dimension(s), but the model was set up with inputs "
        f"of {len(example_shape)} {tuple(example_shape)}: (batch, sequence) token ids. Batch the samples (a "
        f"DataLoader with batch_size, not batch_size=None) or add the batch dimension (inputs.unsqueeze(0)); "
        f"pipeline micro-batches split dimension 0 and sequence parallelism dimension 1."
    )


def count_targets(targets: Any, ignore_index: Optional[int] = -100) -> Tensor:
    """How many elements a mean-reduced loss averages over (integer targets skip ``ignore_index``).

    Example:
        >>> count_targets(torch.zeros(2, 3)).item()
        6.0
    """
    if not isinstance(targets, Tensor):
        raise TypeError(
            f"targets must be a tensor to weight the loss, got {type(targets).__name__}. Override "
            f"`count_targets(self, targets)` on your FourDModule for other target types."
        )
    if not targets.is_floating_point() and ignore_index is not None:
        return (targets != ignore_index).sum().to(torch.float64)
    return torch.full((), targets.numel(), dtype=torch.float64, device=targets.device)  # a fill: no host copy


def with_value(grad_source: Tensor, value: Tensor) -> Tensor:
    """A tensor whose value is ``value`` and whose gradient is that of ``grad_source``.

    Example:
        >>> x = torch.tensor(2.0, requires_grad=True)
        >>> y = with_value(3 * x, torch.tensor(7.0)); y.backward()
        >>> (y.item(), x.grad.item())
        (7.0, 3.0)
    """
    return grad_source + (value.to(grad_source.dtype) - grad_source).detach()


def token_weighted(mean: Tensor, n: Union[float, Tensor], total: Union[float, Tensor], scale: float = 1.0) -> Tensor:
    """A mean loss over ``n`` targets as its share of a mean over ``total``, times ``scale``: ``mean · n / total ·
    scale``. The one weighting rule of the package: data parallelism (:func:`weighted_global_loss`, ``scale = dp``
    because gradients are averaged over ``dp``) and pipeline micro-batches (:mod:`lightning_4d.pipeline.runner`).

    ``n`` and ``total`` may be device tensors (counts never leave the device): the factor is then computed in their
    precision (float64 counts) and applied in ``mean``'s compute precision (float32 for bf16), as a Python float would
    be. A ``mean`` over
    nothing (``n == 0``, NaN) contributes an exact zero, and so does everything when ``total == 0``; its backward
    then hands ``loss_fn`` a zero gradient.

    Example:
        >>> token_weighted(torch.tensor(2.0), 3, 12, scale=2.0).item()
        1.0
        >>> token_weighted(torch.tensor(float("nan")), torch.tensor(0.0), torch.tensor(12.0)).item()
        0.0
    """
    if not isinstance(n, Tensor) and not isinstance(total, Tensor):
        return mean * (float(n) * scale / float(total))
    n_t, total_t = (x.to(device=mean.device, dtype=torch.float64) if isinstance(x, Tensor)
                    else torch.full((), float(x), dtype=torch.float64, device=mean.device) for x in (n, total))
    keep = (n_t > 0) & (total_t > 0)
    factor = torch.where(keep, n_t * scale / torch.where(keep, total_t, 1.0), 0.0)  # () float64
    opmath = torch.promote_types(mean.dtype, torch.float32)  # as a kernel takes a Python scalar: no bf16 factor
    kept = torch.where(keep, mean, torch.zeros((), dtype=mean.dtype, device=mean.device))
    return (kept.to(opmath) * factor.to(opmath)).to(mean.dtype)


def weighted_global_loss(local_loss: Tensor, n_local: Tensor, dp_group: Optional[dist.ProcessGroup],
                         dp_size: int) -> Tensor:
    """Turn a rank's mean loss into the global-batch mean (value) with DP-averaged-correct gradients.

    Example:
        >>> weighted_global_loss(torch.tensor(2.0), torch.tensor(4.0), None, 1).item()
        2.0
        >>> weighted_global_loss(torch.tensor(float("nan")), torch.tensor(0.0), None, 1).item()  # nothing to average
        0.0
    """
    from torch.distributed.tensor import DTensor

    if isinstance(local_loss, DTensor):  # loss_parallel returns a replicated DTensor scalar
        local_loss = local_loss.to_local()
    n_local = n_local.to(device=local_loss.device, dtype=torch.float64)
    # No valid target here (e.g. a context-parallel chunk of padding): the mean is 0/0, counted as 0. Decided on the
    # device: the step reads nothing on the host here.
    safe = torch.where(n_local > 0, local_loss.detach().to(torch.float64), 0.0)
    # (2,) float64: [Σ n_r L_r, Σ n_r], one all-reduce over the dp group
    stats = torch.stack([safe * n_local, n_local])
    all_reduce_sum(stats, dp_group)
    total_loss, n_total = stats[0], stats[1]
    value = torch.where(n_total > 0, total_loss / torch.where(n_total > 0, n_total, 1.0), 0.0)
    return with_value(token_weighted(local_loss, n_local, n_total, dp_size), value)
