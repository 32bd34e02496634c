"""Set-up checks: the rewritten model against the output traced on the unsharded model.

:func:`lightning_4d.analysis.trace.trace_model` keeps the unsharded model's output on a tiny input; after tensor
parallelism the same input must give the same output within a
tolerance derived from the dtype and the output's scale, the package's one rule for set-up checks
(:func:`lightning_4d.core.precision.allowed_difference`). With a pipeline the stages are replayed in order instead
(:func:`lightning_4d.layout.pipeline_glue.check_after_tensor_parallel` chooses). Mixture-of-experts layers, whose routing
is data-dependent, replay the unsharded forward's calls meanwhile (:mod:`lightning_4d.layout.expert_replay`).

Example:
    >>> import torch
    >>> lin, x = torch.nn.Linear(2, 2), torch.ones(1, 2)
    >>> check_tensor_parallel(lin, x, lin(x).detach())  # the same forward: passes
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from lightning_4d.core.distributed import is_on_meta, to_full
from lightning_4d.analysis.hooks import TP_PLAN, hook_call
from lightning_4d.core.precision import allowed_difference, max_difference

__all__ = ["changed_output_error", "check_tensor_parallel", "compare_forward"]


def compare_forward(module: nn.Module, run: Callable[[], Any], expected: Any,
                    failed: Callable[[Exception], ValueError], differs: Callable[[float, float], ValueError]) -> None:
    """The package's one forward-compare check: ``run()`` (a forward of ``module`` or of its pieces) in eval mode
    without grad, compared with ``expected`` within :func:`lightning_4d.core.precision.allowed_difference`. An exception
    raises ``failed(err)``; a difference raises ``differs(diff, allowed)`` (called in eval mode without grad, so it
    may run more forwards to say where). Nothing is compared on the meta device.

    Example:
        >>> lin, x = nn.Linear(2, 2), torch.ones(1, 2)
        >>> compare_forward(lin, lambda: lin(x), lin(x).detach(), ValueError, lambda d, a: ValueError(d))  # equal
    """
    if is_on_meta(module):
        return  # a dry run on the meta device: no values to compare
    was_training = module.training
    module.eval()  # dropout off for the comparison
    try:
        with torch.no_grad():
            try:
                got = run()
            except Exception as err:  # noqa: BLE001 - reported by the caller's message
                raise failed(err) from err
            diff, scale = max_difference(to_full(got), expected) or (0.0, 0.0)
            allowed = allowed_difference(expected, scale)
            if diff > allowed:
                raise differs(diff, allowed)
    finally:
        module.train(was_training)


def check_tensor_parallel(module: nn.Module, example: Any, expected: Any) -> None:
    """Run the sharded model (no pipeline) on the traced input and compare with the unsharded output (every rank,
    same input): :func:`compare_forward`. A rewrite that changes the forward fails here, loudly, naming the
    innermost module whose forward failed, instead of training on.

    Example:
        >>> lin, x = nn.Linear(2, 2), torch.ones(1, 2)
        >>> check_tensor_parallel(lin, x, lin(x).detach() + 1)
        Traceback (most recent call last):
        ...
        ValueError: Linear: the tensor-parallel rewrite changes its output (max abs difference 1 on a test input)...
    """
    names = {id(m): n for n, m in module.named_modules()}
    stack: list[str] = []

    def enter(mod: nn.Module, _args: tuple) -> None:
        stack.append(names.get(id(mod), type(mod).__name__))

    def leave(_mod: nn.Module, _args: tuple, _out: Any) -> None:
        if stack:
            stack.pop()

    def run() -> Any:
        hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
        try:
            return module(*(example if isinstance(example, tuple) else (example,)))
        finally:
            for h in hooks:
                h.remove()

    def failed(err: Exception) -> ValueError:
        inner = [n for n in stack if n]
        where = inner[-1] if inner else type(module).__name__
        return ValueError(
            f"{type(module).__name__}: the forward of {where} fails after the tensor-parallel rewrite "
            f"({type(err).__name__}: {err}). Attention/MLP code must take head counts and widths from attributes "
            f"(divided by tp, e.g. `self.n_head`, `self.split_size`) or from `-1` in view/reshape, not from its "
            f"input's width (`C // self.n_head` with `B, T, C = x.size()`); otherwise implement "
            f"{hook_call(TP_PLAN)}, or use tp=1."
        )

    compare_forward(module, run, expected, failed, lambda diff, _allowed: changed_output_error(module, diff))


def changed_output_error(module: nn.Module, diff: float, where: str = "") -> ValueError:
    """The error of a rewrite whose forward gives other values on the test input (``where``: the place compared,
    when not the model's output); the one wording of the value checks.

    Example:
        >>> str(changed_output_error(nn.Linear(2, 2), 0.5, "at the input of layers.0.moe"))  # doctest: +ELLIPSIS
        'Linear: the tensor-parallel rewrite changes its output (max abs difference 0.5 at the input of layers.0.moe...'
    """
    return ValueError(
        f"{type(module).__name__}: the tensor-parallel rewrite changes its output (max abs difference {diff:.3g} "
        f"{where + ' ' if where else ''}on a test input). Implement {hook_call(TP_PLAN)} for this model."
    )
