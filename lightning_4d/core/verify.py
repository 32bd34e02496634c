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

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from lightning_4d.core.distributed import is_on_meta, to_full
from lightning_4d.analysis.hooks import TP_PLAN, hook_call
from lightning_4d.core.precision import allowed_difference, max_difference

__all__ = ["REWRITES_ATTR", "changed_output_error", "check_tensor_parallel", "compare_forward", "running_modules",
           "tensor_parallel_failure"]


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
    with running_modules(module) as where:
        compare_forward(module, lambda: module(*(example if isinstance(example, tuple) else (example,))), expected,
                        lambda err: tensor_parallel_failure(module, where(), err),
                        lambda diff, _allowed: changed_output_error(module, diff))


@contextmanager
def running_modules(module: nn.Module) -> Iterator[Callable[[], str]]:
    """While active, a function naming the innermost module of ``module`` that entered its forward and has not
    returned (the one whose forward raised, after an exception).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> with running_modules(net) as where:
        ...     _ = net(torch.ones(1, 2))
        >>> where()
        ''
    """
    names = {id(m): n for n, m in module.named_modules()}
    stack: list[str] = []

    def enter(mod: nn.Module, _args: tuple) -> None:
        if id(mod) in names:
            stack.append(names[id(mod)])

    def leave(mod: nn.Module, _args: tuple, _out: Any) -> None:
        if id(mod) in names and stack:
            stack.pop()

    hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        yield lambda: next((n for n in reversed(stack) if n), "")
    finally:
        for h in hooks:
            h.remove()


#: Set by the tensor-parallel rewrite on each module it gave per-rank integers: ``{attribute: (whole, per rank)}``
#: (``"config.n_head"`` for its config's); named when that module's forward then fails.
REWRITES_ATTR = "_fourd_tp_rewrites"


def tensor_parallel_failure(module: nn.Module, where: str, err: Exception) -> ValueError:
    """The error of a forward that raised after the tensor-parallel rewrite, naming the innermost module that failed
    (``where``), what the rewrite changed in it or the nearest module around it that it changed, and the fix.

    Example:
        >>> str(tensor_parallel_failure(nn.Linear(2, 2), "", RuntimeError("boom"))).split(" (")[0]
        'Linear: the forward of Linear fails after the tensor-parallel rewrite'
    """
    owner, path = None, where
    while True:
        found = module.get_submodule(path) if path else module
        if getattr(found, REWRITES_ATTR, None):
            owner = path
            break
        if not path:
            break
        path = path.rpartition(".")[0]
    if owner is not None:
        rewrites = getattr(module.get_submodule(owner) if owner else module, REWRITES_ATTR)
        changed = ", ".join(f"{a} {whole} -> {local}" for a, (whole, local) in sorted(rewrites.items()))
        cause = (f"The rewrite gave {owner or type(module).__name__} per-rank values of the integers its forward was "
                 f"traced reading that count the heads of its projections ({changed}); a size it takes from "
                 f"anywhere else (an integer it was not seen reading on itself or its `config`, an argument, its "
                 f"input's width) still has the whole model's value.")
    else:
        cause = ("No integer it was traced reading on itself or its `config` counts the heads of the projections "
                 "tensor parallelism splits, so none was given a per-rank value: a size it takes from anywhere else "
                 "(an argument, a parent's attribute, its input's width) still has the whole model's value.")
    return ValueError(
        f"{type(module).__name__}: the forward of {where or type(module).__name__} fails after the tensor-parallel "
        f"rewrite ({type(err).__name__}: {err}). {cause} Fix: implement {hook_call(TP_PLAN)} for this model, or use "
        f"tp=1."
    )


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
