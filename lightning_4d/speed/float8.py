"""Float8 training with torchao: the ``float8`` option's rules and its application.

``FourDStrategy(float8=True)`` swaps the plan's linear layers for torchao's ``Float8Linear`` before tensor
parallelism, by TorchTitan's rule: every ``nn.Linear`` whose input and output features are both divisible by 16,
except the output head (the modules the plan runs after the blocks) and a mixture-of-experts layer's router and
experts. The experts stay in the trainer's precision: torchao's grouped Float8 GEMM
(``torchao.prototype.moe_training``) is a CUDA prototype for its own expert layout, not the package's experts; the
plan says so (``LayoutPlan.float8_experts``).

Scaling is dynamic, ``float8_recipe="tensorwise"`` (default: one scale per tensor) or ``"rowwise"`` (one per row,
more accurate, slower). With tensorwise scaling, tensor parallelism uses torchao's Float8 styles
(``Float8ColwiseParallel`` / ``Float8RowwiseParallel``: the input is cast to Float8 before it is gathered) and FSDP2
gathers the weights in Float8 (``enable_fsdp_float8_all_gather``; their scales are computed for all weights at once
after each optimizer step, ``precompute_float8_dynamic_scale_for_fsdp``). On a CPU the GEMMs are emulated (the
values are rounded to Float8 and multiplied in fp32: ``Float8LinearConfig(emulate=True)``); on a GPU with Float8
tensor cores they run torch's ``_scaled_mm``. torchao is the optional extra ``lightning-4d[float8]``.

Example:
    >>> from torch import nn
    >>> model = nn.ModuleDict({"w1": nn.Linear(32, 64), "w2": nn.Linear(32, 10), "output": nn.Linear(64, 32)})
    >>> float8_linear_names(model, exclude=("output",))
    ('w1',)
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn

from lightning_4d._compat import registered_submodule

__all__ = ["FLOAT8_RECIPES", "EXPERTS_NOTE", "apply_float8", "apply_plan_float8", "emulated", "float8_collectives", "check_float8", "float8_linear_names",
           "float8_tp_style", "precompute_fsdp_scales"]

FLOAT8_RECIPES = ("tensorwise", "rowwise")
#: Features of a Float8 GEMM operand must be multiples of this (the Float8 tensor cores' tile).
FLOAT8_MULTIPLE = 16
EXPERTS_NOTE = ("experts kept in the trainer's precision: torchao's grouped Float8 GEMM is a CUDA prototype for its "
                "own expert layout")


def check_float8(float8: bool, recipe: str) -> None:
    """Refuse a bad ``float8`` / ``float8_recipe`` pair, or ``float8=True`` without torchao installed. Pure.

    Example:
        >>> check_float8(False, "tensorwise")
        >>> check_float8(True, "blockwise")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: float8_recipe='blockwise' is not supported. Use 'tensorwise' ...
    """
    if not isinstance(float8, bool):
        raise ValueError(f"float8={float8!r} must be True or False.")
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"float8_recipe={recipe!r} is not supported. Use 'tensorwise' (one scale per tensor, "
                         f"default; Float8 all-gathers under tp and FSDP2) or 'rowwise' (one scale per row).")
    if float8 and importlib.util.find_spec("torchao") is None:
        raise ValueError("float8=True needs torchao (its Float8 training), which is not installed. Install it with "
                         "`pip install 'lightning-4d[float8]'` (or `pip install torchao`), or set float8=False.")


def float8_linear_names(module: nn.Module, exclude: Sequence[str] = (), experts: Iterable[Any] = ()) -> tuple[str, ...]:
    """The linear layers of ``module`` Float8 training converts, by TorchTitan's rule: plain ``nn.Linear`` with
    both feature counts divisible by 16, not at or under an ``exclude`` path (the output head: the plan's
    ``post`` modules), not in an MoE layer's experts or its router (``experts``: the plan's
    :class:`~lightning_4d.plan.ExpertEntry` values). Pure; in module order.

    Example:
        >>> float8_linear_names(nn.Sequential(nn.Linear(16, 48), nn.Linear(48, 8)))
        ('0',)
    """
    skip = tuple(exclude) + tuple(e.experts_path for e in experts)
    routers = {(e.layer, e.experts) for e in experts}
    names = []
    for name, sub in module.named_modules():
        if not name or not isinstance(sub, nn.Linear) or _under(name, skip):
            continue
        if any(_under(name, (layer,)) and sub.out_features == n for layer, n in routers):
            continue  # the router: one score per expert
        if sub.in_features % FLOAT8_MULTIPLE == 0 and sub.out_features % FLOAT8_MULTIPLE == 0:
            names.append(name)
    return tuple(names)


def _under(name: str, prefixes: Sequence[str]) -> bool:
    return any(p and (name == p or name.startswith(p + ".")) for p in prefixes)


def _torchao_float8() -> Any:
    try:
        import torchao.float8 as f8
    except ImportError as err:  # check_float8 refused this at set-up; a plan applied directly lands here
        raise ValueError("Float8 training needs torchao: `pip install 'lightning-4d[float8]'`.") from err
    return f8


def apply_float8(module: nn.Module, names: Sequence[str], recipe: str, emulate: bool, fsdp_all_gather: bool) -> int:
    """Swap the linear layers ``names`` of ``module`` (those on this rank) for torchao's ``Float8Linear`` in place;
    returns how many. ``emulate``: round to Float8 and multiply in fp32 (a CPU, a GPU without Float8 tensor
    cores); ``fsdp_all_gather``: FSDP2 gathers the weights in Float8 (tensorwise only).

    Example:
        >>> # not run: needs a process group
        >>> apply_float8(model, ("layers.0.w1",), "tensorwise", emulate=True, fsdp_all_gather=False)  # doctest: +SKIP
        1
    """
    f8 = _torchao_float8()
    if recipe == "tensorwise":
        config = f8.Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather)
    else:
        config = dataclasses.replace(f8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    wanted = set(names)
    present = [n for n, m in module.named_modules() if n in wanted and type(m) is nn.Linear]
    if present:
        f8.convert_to_float8_training(module, config=config, module_filter_fn=lambda _m, fqn: fqn in wanted)
    return len(present)


def emulated(device: torch.device) -> bool:
    """Whether Float8 GEMMs are emulated on ``device``: anything but a GPU with Float8 tensor cores (compute
    capability 8.9 or more: Ada, Hopper, Blackwell).

    Example:
        >>> emulated(torch.device("cpu"))
        True
    """
    return device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)


def apply_plan_float8(module: nn.Module, plan: Any, dims: Any,
                      device: Optional[torch.device] = None) -> bool:
    """Convert the plan's (a :class:`~lightning_4d.plan.LayoutPlan`) ``float8_linears`` present on this rank (before tensor parallelism); returns whether FSDP2
    gathers their weights in Float8 (tensorwise scaling with sharded data parallelism: the scales are then computed
    after each optimizer step, :func:`precompute_fsdp_scales`).

    Example:
        >>> # not run: needs a process group
        >>> apply_plan_float8(model, plan, dims, torch.device("cpu"))  # doctest: +SKIP
        False
    """
    if device is None:  # where the model will run: where its parameters are
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
    comm = float8_collectives(device) and plan.float8 == "tensorwise"
    fsdp = comm and dims.dp_cp > 1 and plan.data_parallel in ("fsdp", "hsdp")
    converted = apply_float8(module, plan.float8_linears, plan.float8, emulate=emulated(device), fsdp_all_gather=fsdp)
    for name in plan.float8_linears:
        found = registered_submodule(module, name)
        if found is not None:
            found.fourd_float8_comm = comm  # type: ignore[assignment]  # read by float8_tp_style
    return fsdp and converted > 0


def float8_collectives(device: torch.device) -> bool:
    """Whether collectives move Float8 tensors on ``device``: NCCL on a GPU does; gloo (a CPU, or ranks sharing a GPU)
    does not, so there torch's own tensor-parallel styles and FSDP2 gather in high precision and each ``Float8Linear``
    casts after the gather — the same values (tensorwise scales are the global maxima either way), more bytes.

    Example:
        >>> float8_collectives(torch.device("cpu"))
        False
    """
    if device.type != "cuda" or not torch.distributed.is_initialized():
        return device.type == "cuda"
    return "nccl" in str(torch.distributed.get_backend()).lower()


def float8_tp_style(module: nn.Module, column: bool, output_layouts: Any) -> Optional[Any]:
    """torchao's Float8 tensor-parallel style for ``module`` (``Float8ColwiseParallel`` / ``Float8RowwiseParallel``,
    DTensor outputs) when it is a tensorwise ``Float8Linear`` whose collectives can move Float8
    (:func:`float8_collectives`); ``None`` otherwise (torch's own styles; the ``Float8Linear`` casts its DTensor
    operands itself).

    Example:
        >>> float8_tp_style(nn.Linear(2, 2), True, None) is None
        True
    """
    if type(module).__name__ != "Float8Linear" or not getattr(module, "fourd_float8_comm", False):
        return None
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    if module.config.cast_config_input.scaling_granularity is not ScalingGranularity.TENSORWISE:
        return None
    if column:
        return Float8ColwiseParallel(use_local_output=False)
    return Float8RowwiseParallel(output_layouts=output_layouts, use_local_output=False)


def precompute_fsdp_scales(model: nn.Module) -> None:
    """After each optimizer step with FSDP2's Float8 all-gather: every Float8 weight's scale in one all-reduce
    (torchao's ``precompute_float8_dynamic_scale_for_fsdp``).

    Example:
        >>> # not run: needs a process group
        >>> precompute_fsdp_scales(model)  # doctest: +SKIP
    """
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
