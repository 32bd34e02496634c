"""The attention functions context parallelism knows, by kind: the one table its interceptors read.

``SDPA``: ``F.scaled_dot_product_attention`` — the call :class:`~.attention.ContextParallelAttention` makes global
across the cp ranks (all-gather or Ulysses) and :func:`~.check.check_context_parallel` traces at set-up.
``SCORES``: the functions attention written by hand computes its ``(T, T)`` scores with (matmul, softmax): the set-up
check refuses them under cp (their scores would cover this rank's chunk only), naming the module.

A new attention kind (e.g. a flex-attention call) is one more row of :data:`ATTENTION_FUNCTIONS` with its kind and a
branch for that kind in the interceptor; the set-up check then counts it like SDPA.

Example:
    >>> import torch.nn.functional as F
    >>> attention_kind(F.scaled_dot_product_attention), attention_kind(torch.matmul), attention_kind(torch.add)
    ('sdpa', 'scores', None)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = ["ATTENTION_FUNCTIONS", "SCORES", "SDPA", "attention_kind"]

SDPA = "sdpa"
SCORES = "scores"

#: ``(function, kind)``: every function a model's attention may call that context parallelism must see.
ATTENTION_FUNCTIONS: tuple[tuple[Any, str], ...] = (
    (F.scaled_dot_product_attention, SDPA),
    *((f, SCORES) for f in (torch.matmul, torch.bmm, torch.baddbmm, torch.einsum, torch.softmax, F.softmax,
                            torch.Tensor.softmax, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.Tensor.bmm)),
)


def attention_kind(func: Any) -> Optional[str]:
    """The kind of ``func`` in :data:`ATTENTION_FUNCTIONS` (by identity: what a ``TorchFunctionMode`` receives), or
    ``None`` for any other function."""
    for known, kind in ATTENTION_FUNCTIONS:
        if func is known:
            return kind
    return None
