"""Set-up checks: the rewritten model against the output traced on the unsharded model.

:func:`lightning_4d.trace.trace_model` keeps the unsharded model's output on a tiny input; after tensor
parallelism (and, with pipelines, stage by stage) the same input must give the same output within a
tolerance derived from the dtype. Both checks share :func:`max_difference` / :func:`output_tolerance`.

Example:
    >>> import torch
    >>> max_difference(torch.ones(2), torch.ones(2)), output_tolerance(torch.ones(2))
    ((0.0, 1.0), 0.0001)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from lightning_4d._compat import pytree

__all__ = ["check_tensor_parallel", "max_difference", "output_tolerance"]


def output_tolerance(expected: Any) -> float:
    """Relative tolerance for comparing with ``expected``: ``1e-4`` in fp32, ``16·eps`` of lower precisions.

    Example:
        >>> output_tolerance(torch.ones(1, dtype=torch.bfloat16))
        0.125
    """
    dtypes = [t.dtype for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return max([1e-4] + [16 * torch.finfo(d).eps for d in dtypes])


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


def check_tensor_parallel(module: nn.Module, split: Any, example: Any, expected: Any) -> None:
    """Run the sharded model on the traced input and compare with the unsharded output (every rank, same
    input). A rewrite that changes the forward fails here, loudly, naming the innermost module whose
    forward failed, instead of training on. With a pipeline, the stages are replayed in order.

    Example:
        >>> check_tensor_parallel(lm, None, tokens, trace.output)  # doctest: +SKIP
    """
    from lightning_4d.distributed import to_full
    from lightning_4d.pipeline.staged import StagedForward, check_staged

    if any(p.is_meta for p in module.parameters()):
        return  # a dry run on the meta device: no values to compare
    if isinstance(split, StagedForward):
        try:
            check_staged(split, example, expected, rtol=output_tolerance(expected))
        except ValueError as err:
            raise ValueError(f"With tensor parallelism: {err}") from err
        return
    if split is not None:
        return  # user pipeline hooks: checked by their own sequential check before sharding
    was_training = module.training
    module.eval()
    names = {id(m): n for n, m in module.named_modules()}
    stack: list[str] = []

    def enter(mod: nn.Module, _args: Any) -> None:
        stack.append(names.get(id(mod), type(mod).__name__))

    def leave(_mod: nn.Module, _args: Any, _out: Any) -> None:
        if stack:
            stack.pop()

    hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        with torch.no_grad():
            got = to_full(module(*(example if isinstance(example, tuple) else (example,))))
    except Exception as err:  # noqa: BLE001 - reported with the hint
        failed = [n for n in stack if n]
        where = failed[-1] if failed else type(module).__name__
        raise ValueError(
            f"{type(module).__name__}: the forward of {where} fails after the tensor-parallel rewrite "
            f"({type(err).__name__}: {err}). Attention/MLP code must take head counts and widths from attributes "
            f"(divided by tp, e.g. `self.n_head`, `self.split_size`) or from `-1` in view/reshape, not from its "
            f"input's width (`C // self.n_head` with `B, T, C = x.size()`); otherwise implement "
            f"`fourd_tp_plan(self, tp_mesh, sequence_parallel)`, or use tp=1."
        ) from err
    finally:
        for h in hooks:
            h.remove()
        module.train(was_training)
    diff, scale = max_difference(got, expected) or (0.0, 0.0)
    if diff > 1e-5 + output_tolerance(expected) * scale:
        raise ValueError(
            f"{type(module).__name__}: the tensor-parallel rewrite changes its output (max abs difference "
            f"{diff:.3g} on a test input). Implement `fourd_tp_plan(self, tp_mesh, sequence_parallel)` for this model."
        )
