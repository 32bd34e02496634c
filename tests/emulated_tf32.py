"""TF32 on CPU, for tests: while :func:`emulated_tf32` is active and ``torch.get_float32_matmul_precision()`` is not
``"highest"``, every fp32 matrix product (``mm``, ``addmm``, ``bmm``, ``baddbmm``: what ``nn.Linear`` and
``matmul`` run) rounds its two operands to TF32's 10-bit mantissa, as an Ampere/Hopper GPU's tensor cores do, and its
result carries a relative error of up to TF32's unit roundoff (2^-11) in a pattern fixed by the product's shapes:
kernels of different shapes (a tensor-parallel shard's product and the whole one) round differently, equal shapes
(every rank's) alike. Deterministic.

Example:
    >>> import torch
    >>> a = torch.tensor([[1.0 + 2**-12]])
    >>> with emulated_tf32():
    ...     torch.set_float32_matmul_precision("high")
    ...     abs((a @ a).item() - 1.0) <= 2**-11
    True
    >>> torch.set_float32_matmul_precision("highest")
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager
from typing import Any, Generator

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TF32_ROUNDOFF", "emulated_tf32", "to_tf32"]

#: TF32's unit roundoff (10 explicit mantissa bits).
TF32_ROUNDOFF = 2.0**-11
_aten = torch.ops.aten
# Positions of the two matrix operands of each product.
_OPERANDS = {_aten.mm.default: (0, 1), _aten.bmm.default: (0, 1), _aten.addmm.default: (1, 2),
             _aten.baddbmm.default: (1, 2)}


def to_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded to the nearest value with a 10-bit mantissa (TF32), kept in fp32."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).view(x.shape)


class _TF32(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local ops, which come back here
        operands = _OPERANDS.get(func)
        if not operands or torch.get_float32_matmul_precision() == "highest" or args[operands[0]].dtype != torch.float32:
            return func(*args, **kwargs)
        args = tuple(to_tf32(a) if i in operands else a for i, a in enumerate(args))
        out = func(*args, **kwargs)
        shapes = repr([tuple(args[i].shape) for i in operands])
        gen = torch.Generator().manual_seed(zlib.crc32(shapes.encode()))
        return out * (1 + TF32_ROUNDOFF * (2 * torch.rand(out.shape, generator=gen) - 1))


@contextmanager
def emulated_tf32() -> Generator[None, None, None]:
    """Emulate TF32 matmuls on CPU while active (see the module's doc)."""
    with _TF32():
        yield
