"""Training FLOPs per token: the package's one formula (the models, the planner and the monitors import it).

``6·N + 12·L·(a·d)·s`` per token of a sequence of ``s`` tokens, forward + backward: ``N`` matmul parameters
a token goes through (without lookup tables; with MoE, ``top_k`` of the routed experts), each costing 2 FLOPs
forward and 4 backward, and the attention matmuls ``QKᵀ`` and ``AV`` over ``L`` layers of ``a`` heads of
``d`` features, without causal halving (the PaLM / TorchTitan convention).

Each model's ``flops_per_token(seq_len)`` and :meth:`lightning_4d.planner.spec.TransformerSpec.flops_per_token`
call :func:`training_flops_per_token` with their own counts; ``FourDThroughputMonitor`` reads the model's
method for MFU.

Example:
    >>> training_flops_per_token(active_params=1000, layers=2, attention_width=64, seq_len=128)
    202608
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["training_flops_per_token"]

Count = TypeVar("Count", int, float)


def training_flops_per_token(active_params: Count, layers: int, attention_width: int, seq_len: int) -> Count:
    """``6 · active_params + 12 · layers · attention_width · seq_len`` (see the module docstring).

    Args:
        active_params: matmul parameters a token goes through (no lookup tables; a float for an expected count).
        layers: attention layers.
        attention_width: query heads × features per head.
        seq_len: tokens per sequence.

    Example:
        >>> training_flops_per_token(10, 1, 4, 2)
        156
    """
    return 6 * active_params + 12 * layers * attention_width * seq_len
