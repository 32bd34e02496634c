"""Precision: the one table from a Lightning precision string to dtypes and bytes, and the one check tolerance.

Every room that needs "what does ``bf16-mixed`` mean" reads :data:`PRECISIONS` through
:func:`precision_info`: FSDP2's mixed-precision policy (:mod:`lightning_4d.layout.data_parallel`), the planner's
bytes per activation (:class:`lightning_4d.planner.spec.TrainSpec`), the dry run's autocast, the
throughput monitor's peak FLOP/s, the communication monitor's expected bytes and the recipes' choices.

Every set-up check that compares a rewritten forward with the unsharded one (tensor parallelism, pipeline
stages, expert parallelism, a ``nn.Linear`` subclass) allows the same difference,
:func:`allowed_difference`: ``1e-5 + rtol · max|expected|`` with ``rtol = max(1e-4, 16·eps)`` of the
expected output's floating dtypes (fp32: ``1e-4``; bf16: ``0.125``; fp16: ``0.0156``), an fp32 matmul's eps being
that of ``torch.get_float32_matmul_precision()`` (TF32's ``2^-10`` at ``"high"``: ``0.0156``). The strategy runs
its set-up checks inside :func:`exact_fp32_matmul` (TF32 off), so they stay at ``1e-4`` whatever the user chose.

A 16-bit run of a parallel layout is compared with one process in the same precision within
:func:`parity_tolerance`, derived from the compute dtype's epsilon and the model's depth (``docs/precision.md``).

Example:
    >>> precision_info("bf16-mixed").compute_bytes, precision_info("32").name
    (2, '32-true')
    >>> allowed_difference(torch.ones(3), scale=2.0)
    0.00021
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generator, Optional, Union

import math

import torch

from lightning_4d._compat import pytree

__all__ = ["ABSOLUTE_TOLERANCE", "MATMUL_EPS", "PLANNER_PRECISIONS", "PRECISIONS", "PRECISION_NAMES", "ParityTolerance",
           "Precision", "allowed_difference", "exact_fp32_matmul", "matmul_eps", "max_difference", "output_tolerance",
           "parity_tolerance", "precision_info"]


@dataclass(frozen=True)
class Precision:
    """What one Lightning precision string means for the package.

    Attributes:
        name: Lightning's name (``"bf16-mixed"``, ...).
        compute_dtype: dtype of the matmuls and activations.
        param_dtype: dtype of the weights the optimizer updates (fp32 under ``*-mixed``).
        fsdp_param_dtype: FSDP2 ``MixedPrecisionPolicy(param_dtype=...)`` the package applies (``None``: no
            policy, parameters gathered in ``param_dtype``).
        planner: the precision the planner models it as (``None``: not modelled); equal to ``name`` when the
            planner's bytes are exact for it.

    Example:
        >>> precision_info("16-true").compute_dtype, precision_info("16-true").planner
        (torch.float16, 'bf16-mixed')
    """

    name: str
    compute_dtype: torch.dtype
    param_dtype: torch.dtype
    fsdp_param_dtype: Optional[torch.dtype]
    planner: Optional[str]

    @property
    def compute_bytes(self) -> int:
        """Bytes of one activation / compute-copy element (2 for bf16 and fp16, 4 for fp32)."""
        return torch.finfo(self.compute_dtype).bits // 8

    @property
    def mixed(self) -> bool:
        """Whether compute runs in a lower precision than the weights (Lightning's autocast)."""
        return self.compute_dtype != self.param_dtype

    @property
    def modelled_exactly(self) -> bool:
        """Whether the planner's byte counts hold for this precision as it is (not an approximation)."""
        return self.planner == self.name


_BF16, _FP16, _FP32, _FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64

#: Lightning's precision strings (its ``_PRECISION_INPUT_STR``, without Transformer Engine's).
PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("bf16-mixed", _BF16, _FP32, _BF16, "bf16-mixed"),
    Precision("32-true", _FP32, _FP32, None, "32-true"),
    Precision("16-mixed", _FP16, _FP32, None, "bf16-mixed"),
    Precision("bf16-true", _BF16, _BF16, None, "bf16-mixed"),
    Precision("16-true", _FP16, _FP16, None, "bf16-mixed"),
    Precision("64-true", _FP64, _FP64, None, None),
)}
#: Lightning's short names.
_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
#: Every value ``trainer.precision`` may take here (the recipes check against it).
PRECISION_NAMES = tuple(PRECISIONS) + tuple(_ALIASES)
#: The precisions the planner's formulas are written for.
PLANNER_PRECISIONS = tuple(name for name, p in PRECISIONS.items() if p.modelled_exactly)


def precision_info(precision: Union[str, int]) -> Precision:
    """The table's entry for a Lightning precision (``trainer.precision``, a short name like ``"32"`` or an int).

    Raises:
        ValueError: naming the value and the known ones.

    Example:
        >>> precision_info(32).name, precision_info("bf16").fsdp_param_dtype
        ('32-true', torch.bfloat16)
    """
    key = _ALIASES.get(str(precision), str(precision))
    if key not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one lightning_4d knows; use one of "
                         f"{sorted(PRECISIONS) + sorted(_ALIASES)}.")
    return PRECISIONS[key]


#: Absolute part of the set-up checks' tolerance (outputs near zero).
ABSOLUTE_TOLERANCE = 1e-5

#: The eps of an fp32 matmul at each ``torch.get_float32_matmul_precision()``: full fp32, TF32 (10 mantissa bits),
#: bf16 passes.
MATMUL_EPS = {"highest": torch.finfo(_FP32).eps, "high": 2.0**-10, "medium": torch.finfo(_BF16).eps}


def matmul_eps() -> float:
    """:data:`MATMUL_EPS` of the current fp32 matmul precision (TF32's where torch cannot name it: precisions set
    per backend in a mix).

    Example:
        >>> matmul_eps() == torch.finfo(torch.float32).eps  # torch's default, "highest"
        True
    """
    try:
        return MATMUL_EPS.get(torch.get_float32_matmul_precision(), MATMUL_EPS["high"])
    except RuntimeError:
        return MATMUL_EPS["high"]


@contextmanager
def exact_fp32_matmul() -> Generator[None, None, None]:
    """fp32 matmuls in full fp32 inside (``torch.set_float32_matmul_precision("highest")``: no TF32), the user's
    precision restored after: the set-up checks compare a rewrite with the whole model in exact fp32 even where the
    user switched TF32 on (Lightning suggests it on every Ampere/Hopper run). Left as it is where torch cannot name
    the precision (set per backend in a mix); the tolerance then assumes TF32 (:func:`matmul_eps`).

    Example:
        >>> torch.set_float32_matmul_precision("high")
        >>> with exact_fp32_matmul():
        ...     torch.get_float32_matmul_precision()
        'highest'
        >>> torch.get_float32_matmul_precision()
        'high'
        >>> torch.set_float32_matmul_precision("highest")
    """
    try:
        before = torch.get_float32_matmul_precision()
    except RuntimeError:
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def output_tolerance(expected: Any) -> float:
    """Relative tolerance for comparing with ``expected``: ``max(1e-4, 16·eps)`` over its floating dtypes, an fp32
    output's eps being its matmuls' (:func:`matmul_eps`): ``1e-4`` in fp32, ``0.0156`` under TF32.

    Example:
        >>> output_tolerance(torch.ones(1, dtype=torch.bfloat16))
        0.125
        >>> output_tolerance(torch.ones(1))
        0.0001
    """
    dtypes = [t.dtype for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return max([1e-4] + [16 * (max(torch.finfo(d).eps, matmul_eps()) if d == _FP32 else torch.finfo(d).eps)
                         for d in dtypes])


def allowed_difference(expected: Any, scale: float) -> float:
    """The largest max-abs difference a set-up check accepts against ``expected`` whose largest magnitude is
    ``scale``: ``ABSOLUTE_TOLERANCE + output_tolerance(expected) · scale``.

    Example:
        >>> allowed_difference(torch.ones(1, dtype=torch.bfloat16), scale=1.0)
        0.12501
    """
    return ABSOLUTE_TOLERANCE + output_tolerance(expected) * scale


def max_difference(got: Any, expected: Any) -> Optional[tuple[float, float]]:
    """``(max abs difference, max abs expected)`` over matching tensor leaves; ``inf`` when the structures or
    shapes differ; ``None`` on the meta device (nothing to compare).

    Example:
        >>> max_difference((torch.zeros(2),), (torch.ones(2),))
        (1.0, 1.0)
    """
    a = [t for t in pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
    b = [t for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)]
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return float("inf"), 0.0
    if any(x.is_meta or y.is_meta for x, y in zip(a, b)):
        return None
    diff = max((float((x.float() - y.float()).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)
    scale = max((float(y.float().abs().max()) for y in b if y.numel()), default=0.0)
    return diff, scale


#: Sequential roundings per transformer sublayer (attention, MLP) whose place a layout may move: its input
#: projections' outputs, its core (attention; the gated activation), its output projection (whose partial sums
#: tensor parallelism rounds before it adds them).
ROUNDINGS_PER_SUBLAYER = 3
#: How many standard deviations of the rounding noise :func:`parity_tolerance` allows.
NOISE_SIGMAS = 4.0


@dataclass(frozen=True)
class ParityTolerance:
    """Relative tolerances of a 16-bit parity check against one process in the same precision.

    Attributes:
        loss: on each step's global-batch loss (``|a − b| / |b|``).
        grad: on each parameter's gradient (``‖a − b‖ / ‖b‖``).
    """

    loss: float
    grad: float


def parity_tolerance(precision: Union[str, int], blocks: int, tokens: int) -> ParityTolerance:
    """How far a correct parallel layout may land from one process in the same 16-bit ``precision``, after one
    optimizer step, for a transformer of ``blocks`` blocks whose loss averages ``tokens`` target tokens.

    Both runs compute the same operations in the same dtypes; a layout rounds some of them at other places
    (partial sums of a split matmul, a block input cast once by FSDP2's policy, another reduction order). Each
    such rounding moves a value by at most the unit roundoff ``u = eps / 2`` relative, independently in the two
    runs: the difference of two runs gains variance ``2u²/3`` per rounding, ``σ(n) = u·√(2n/3)`` after ``n``.
    A forward's longest path holds ``n_f = 2·3·blocks + 1`` of them (:data:`ROUNDINGS_PER_SUBLAYER` per sublayer,
    two sublayers per block, the output head); a gradient adds the backward's mirror of it, ``n = 2·n_f``.

    - ``grad = 4·σ(n)``: a weight's gradient sums its tokens' terms, which cancel (a norm scale's do), so no
      averaging over tokens is credited;
    - ``loss = 4·σ(n_f) / √tokens`` (the loss averages independent per-token errors), plus ``eps`` when the loss
      itself is held in the 16-bit dtype (``*-true``: its last rounding may differ by one unit in the last place).

    fp32 runs are checked against their own reordering noise instead (the compute dtype's accumulation, not its
    output roundings, dominates there): this raises for them.

    Example:
        >>> t = parity_tolerance("bf16-mixed", blocks=2, tokens=100)
        >>> round(t.grad, 4), round(t.loss, 5)
        (0.0651, 0.0046)
        >>> round(parity_tolerance("bf16-true", blocks=2, tokens=100).loss, 4)
        0.0124

    Raises:
        ValueError: for a precision whose compute dtype is not 16-bit, or non-positive ``blocks`` / ``tokens``.
    """
    info = precision_info(precision)
    if info.compute_bytes != 2:
        raise ValueError(f"parity_tolerance: precision={info.name!r} computes in {info.compute_dtype}; it derives "
                         f"16-bit tolerances only (bf16-mixed, bf16-true, 16-mixed, 16-true).")
    if blocks < 1 or tokens < 1:
        raise ValueError(f"parity_tolerance: blocks={blocks} and tokens={tokens} must both be >= 1.")
    eps = torch.finfo(info.compute_dtype).eps
    forward = 2 * ROUNDINGS_PER_SUBLAYER * blocks + 1

    def sigma(n: int) -> float:
        return eps / 2 * math.sqrt(2 * n / 3)

    last_rounding = eps if not info.mixed else 0.0
    return ParityTolerance(loss=NOISE_SIGMAS * sigma(forward) / math.sqrt(tokens) + last_rounding,
                           grad=NOISE_SIGMAS * sigma(2 * forward))
