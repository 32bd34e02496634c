"""Token-level ``torchmetrics`` metrics of a language model that come out right under every layout.

Under :class:`~lightning_4d.FourDStrategy` a batch's outputs exist only on the ranks of the last pipeline
stage, and there once per tensor-parallel rank (logits sharded over the vocabulary). A ``torchmetrics``
metric is right when it is

1. updated where the outputs are — in ``loss_fn``, which runs on the last stage, once per micro-batch, with
   that micro-batch's outputs and targets (:attr:`lightning_4d.FourDModule.fourd_stage` says whether this is
   validation or test);
2. synced over the data-parallel group only (``process_group=module.fourd_dp_group``): tensor-parallel peers
   and pipeline ranks hold the same samples and are not extra data;
3. computed on the last stage and handed to the other pipeline ranks
   (:meth:`lightning_4d.FourDModule.fourd_log_metric`).

:func:`token_predictions` is the argmax over the vocabulary, exact for vocabulary-sharded logits without
gathering them (one all-gather of the per-shard maxima). :class:`TokenAccuracy` and :class:`TokenPerplexity`
are what :class:`~lightning_4d.models.CausalLM` logs as ``val_acc`` / ``val_ppl`` (``test_…`` in testing).

Example:
    >>> acc = TokenAccuracy()
    >>> acc.update(torch.tensor([[1, 2, 3]]), torch.tensor([[1, 0, -100]]))
    >>> acc.compute()
    tensor(0.5000)
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric

__all__ = ["TokenAccuracy", "TokenPerplexity", "local_value", "token_predictions"]


def local_value(value: Tensor) -> Tensor:
    """A plain tensor of a (replicated) DTensor value, e.g. the loss ``loss_parallel`` returns; other tensors as
    they are.

    Example:
        >>> local_value(torch.tensor(2.0))
        tensor(2.)
    """
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        if all(p.is_replicate() for p in value.placements):
            return value.to_local()
        return value.full_tensor()
    return value


def _vocab_shard(logits: Tensor) -> Optional[tuple[dist.ProcessGroup, int]]:
    """(group, mesh dim) when ``logits`` is a DTensor sharded over its last dim only and evenly by the chunk rule."""
    from torch.distributed.tensor import DTensor

    if not isinstance(logits, DTensor):
        return None
    last = logits.ndim - 1
    sharded = [i for i, p in enumerate(logits.placements) if p.is_shard()]
    if len(sharded) != 1 or not logits.placements[sharded[0]].is_shard(last) or \
            any(p.is_partial() for p in logits.placements):
        return None
    return logits.device_mesh.get_group(sharded[0]), sharded[0]


@torch.no_grad()
def token_predictions(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)`` as a plain tensor, exactly as one process computes it (the first index of the
    maximum), also for logits sharded over the vocabulary by tensor parallelism: each rank takes the maximum of
    its shard, the ``(value, index)`` pairs are all-gathered over the shard's group (``B·T`` values, not the
    ``B·T·V`` logits), and the largest value with the smallest index wins. Any other DTensor is gathered.

    Example:
        >>> token_predictions(torch.tensor([[[0.1, 0.9, 0.9], [2.0, 0.0, 1.0]]]))
        tensor([[1, 0]])
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(logits, DTensor):
        return logits.argmax(-1)
    shard = _vocab_shard(logits)
    if shard is None:
        return logits.full_tensor().argmax(-1)
    group, mesh_dim = shard
    local = logits.to_local()
    vocab, n = logits.shape[-1], logits.device_mesh.size(mesh_dim)
    rank = logits.device_mesh.get_local_rank(mesh_dim)
    chunk = math.ceil(vocab / n)
    if local.shape[-1] != max(0, min(vocab, (rank + 1) * chunk) - rank * chunk):
        return logits.full_tensor().argmax(-1)  # not torch.chunk's split: take the safe path
    if local.shape[-1] == 0:
        value = torch.full(local.shape[:-1], float("-inf"), device=local.device, dtype=local.dtype)
        index = torch.zeros(local.shape[:-1], device=local.device, dtype=torch.long)
    else:
        value, index = local.max(-1)
    index = index + rank * chunk
    values = [torch.empty_like(value) for _ in range(n)]
    indices = [torch.empty_like(index) for _ in range(n)]
    dist.all_gather(values, value.contiguous(), group=group)
    dist.all_gather(indices, index.contiguous(), group=group)
    vals, idx = torch.stack(values), torch.stack(indices)  # (n, ...)
    best = vals.max(0).values
    hit = (vals == best) | (torch.isnan(vals) & torch.isnan(best))  # torch.argmax takes the first NaN as the max
    return torch.where(hit, idx, torch.full_like(idx, torch.iinfo(torch.long).max)).min(0).values


class TokenAccuracy(Metric):
    """Share of target tokens (those not ``ignore_index``) predicted right; ``preds`` are token ids (see
    :func:`token_predictions`). States are integer counts summed over the process group, so the value is the
    same as one process's ``MulticlassAccuracy(average="micro", ignore_index=...)`` on the whole data.

    Example:
        >>> m = TokenAccuracy(ignore_index=-1)
        >>> m.update(torch.tensor([3, 4]), torch.tensor([3, -1])); m.compute()
        tensor(1.)
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    correct: Tensor
    total: Tensor

    def __init__(self, ignore_index: int = -100, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("correct", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Tensor, targets: Tensor) -> None:
        """Count the targets that are not ignored and those ``preds`` gets right."""
        if preds.shape != targets.shape:
            raise ValueError(f"preds of shape {tuple(preds.shape)} and targets of shape {tuple(targets.shape)} "
                             f"differ; pass token ids (token_predictions(logits)), not logits")
        valid = targets != self.ignore_index
        self.correct += ((preds == targets) & valid).sum()
        self.total += valid.sum()

    def compute(self) -> Tensor:
        """``correct / total`` (float32, as torchmetrics divides); 0 without targets."""
        if int(self.total) == 0:
            return torch.zeros((), device=self.total.device)
        return self.correct.float() / self.total.float()


class TokenPerplexity(Metric):
    """``exp(Σ nll / Σ tokens)`` over every target token of the data (token-weighted, so batches with fewer
    answer tokens do not count as much as full ones). Updated with a batch's summed negative log-likelihood and
    its token count, e.g. ``loss · n`` of a mean cross-entropy; the sums are kept in float64.

    Example:
        >>> m = TokenPerplexity()
        >>> m.update(torch.tensor(2.0), torch.tensor(2)); m.update(torch.tensor(0.0), torch.tensor(2))
        >>> round(float(m.compute()), 4)  # exp(2 / 4)
        1.6487
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    nll: Tensor
    total: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("nll", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, nll_sum: Tensor, count: Tensor) -> None:
        """Add a batch's summed negative log-likelihood and its number of target tokens."""
        count = torch.as_tensor(count, device=self.total.device)
        if int(count) == 0:
            return  # a mean over no tokens is NaN; it contributes nothing
        self.nll += torch.as_tensor(nll_sum, device=self.nll.device).detach().to(torch.float64)
        self.total += count.to(torch.long)

    def compute(self) -> Tensor:
        """The perplexity (float32); ``nan`` without tokens."""
        if int(self.total) == 0:
            return torch.tensor(float("nan"), device=self.nll.device)
        return torch.exp(self.nll / self.total).float()
