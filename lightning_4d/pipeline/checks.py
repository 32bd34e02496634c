"""Single-process checks that pipeline stages, run in order, compute the model's forward: :func:`check_staged` for
any :class:`~lightning_4d.pipeline.stages.StageForward` (before and after the tensor-parallel rewrite),
:func:`check_sequential` for a chain pre → blocks → post before sharding (it also says which side differs).

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    ...     def forward(self, x):
    ...         for layer in self.layers:
    ...             x = layer(x)
    ...         return x
    >>> check_sequential(Net(), torch.ones(1, 2))
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_4d._compat import child_modules, registered_submodule
from lightning_4d.pipeline.stages import HOOK_HINT, ChainForward, PipelineSplit, StageForward, find_pipeline_split
from lightning_4d.core.precision import max_difference
from lightning_4d.core.verify import compare_forward

__all__ = ["check_sequential", "check_staged"]


def check_staged(stages: StageForward, example: Any, expected: Any,
                 failed: Optional[Callable[[Exception], ValueError]] = None,
                 differs: Optional[Callable[[float, float], ValueError]] = None) -> None:
    """Run every stage in order in one process on ``example`` and compare with ``expected`` (the plain
    forward's output) within :func:`lightning_4d.core.precision.allowed_difference`. Raises a ``ValueError``
    naming the model and the hooks when they differ; a caller checking something else through the stages (the
    tensor-parallel rewrite) gives its own errors (``failed(err)``, ``differs(diff, allowed)``).

    Example:
        >>> from lightning_4d.models import Llama, LlamaConfig
        >>> from lightning_4d.pipeline.staged import prepare_staged
        >>> from lightning_4d.analysis.trace import trace_model
        >>> lm = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_hidden=32, max_seq_len=8))
        >>> tokens = torch.randint(0, 32, (2, 8))
        >>> trace = trace_model(lm, "layers", tokens)
        >>> check_staged(prepare_staged(lm, trace, num_stages=2), tokens, trace.output)  # equal: passes
    """
    cls = type(stages.root).__name__

    def run() -> Any:
        h: Any = example if isinstance(example, tuple) else (example,)
        for index in range(stages.num_stages):
            h = stages.run(index, h if index == 0 or isinstance(h, tuple) else (h,), example)  # (hidden, *carried)
        return h

    compare_forward(stages.root, run, expected, failed or (lambda err: ValueError(
        f"{cls}: running its forward stage by stage failed with {type(err).__name__}: {err}. Pipeline stages "
        f"run {stages.describe()}; otherwise {HOOK_HINT}."
    )), differs or (lambda diff, _allowed: ValueError(
        f"{cls}: its forward run stage by stage differs from the plain forward (max abs difference {diff:.3g}). "
        f"Pipeline stages run {stages.describe()}; if that changes the values, {HOOK_HINT}."
    )))


def _diff(a: Any, b: Any) -> float:
    compared = max_difference(a, b)
    return compared[0] if compared is not None else 0.0


def check_sequential(
    model: nn.Module,
    sample_input: Any,
    *,
    split: Optional[PipelineSplit] = None,
    blocks_path: Optional[str] = None,
    pre_fn: Optional[Callable[..., Any]] = None,
    post_fn: Optional[Callable[[Any], Any]] = None,
) -> None:
    """Check, before splitting and in one process, that the stage composition equals ``model(sample_input)``.

    Runs pre-modules (or ``pre_fn``) → every block → post-modules (or ``post_fn``) on a tiny input in
    eval mode without grad, and compares against the model's forward (within
    :func:`lightning_4d.core.precision.allowed_difference`). The first block's input and
    the last block's output are captured from the real forward to tell which side differs.

    Raises:
        ValueError: naming the model class, the side that differs and the hook to implement.

    Example:
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.emb = nn.Embedding(5, 2)
        ...         self.layers = nn.ModuleList([nn.Linear(2, 2)])
        ...     def forward(self, x):
        ...         return self.layers[0](self.emb(x) * 2)
        >>> check_sequential(Net(), torch.zeros(1, 3, dtype=torch.long))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Net: its forward is not the plain composition ... (pre)). ... `pipeline_pre_blocks(self, inputs)`...
    """
    cls = type(model).__name__
    split = split or find_pipeline_split(model, blocks_path)
    whole = ChainForward(model, split, {0: split.block_keys}, pre_fn, post_fn)
    container = registered_submodule(model, split.blocks_path)
    assert container is not None
    blocks = child_modules(container)
    first, last = blocks[split.block_keys[0]], blocks[split.block_keys[-1]]
    seen: dict[str, Any] = {}
    hooks = [first.register_forward_pre_hook(lambda m, a: seen.setdefault("in", a)),
             last.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out))]
    args = sample_input if isinstance(sample_input, tuple) else (sample_input,)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model(*args)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    chain = " → ".join(split.pre + (split.blocks_path + "[*]",) + split.post)

    def differs(err: float, allowed: float) -> ValueError:  # called in eval mode, without grad
        side = "the modules after the blocks (post) or the blocks themselves"
        if "in" in seen:
            pre_out = whole.run_pre(args)
            block_in = seen["in"][0] if len(seen["in"]) == 1 else seen["in"]
            if _diff(pre_out, block_in) > allowed:
                side = "the modules before the blocks (pre)"
            elif "out" in seen:
                last_out = seen["out"]
                post_out = whole.run_post(last_out)
                if _diff(post_out, expected) > allowed:
                    side = "the modules after the blocks (post)"
                else:
                    side = "the blocks (they are not called in order on one tensor)"
        return ValueError(
            f"{cls}: its forward is not the plain composition {list(split.pre)} → {split.blocks_path}[*] → "
            f"{list(split.post)} (max abs difference {err:.3g}, in {side}). Pipeline stages run that "
            f"composition, so {HOOK_HINT}."
        )

    compare_forward(model, lambda: whole.run(0, args, None), expected, lambda err: ValueError(
        f"{cls}: running its modules in order ({chain}) failed with {type(err).__name__}: {err}. Pipeline stages "
        f"run that composition, so its forward must be a plain chain; otherwise {HOOK_HINT}."
    ), differs)
