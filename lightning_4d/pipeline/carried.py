"""Values computed before the blocks that blocks on later pipeline stages read: sent on, never stood in for.

A pipelined model runs its own forward on every stage (:mod:`lightning_4d.pipeline.staged`). On later stages the
modules before the blocks that hold parameters are shape stand-ins (:class:`~lightning_4d.pipeline.staged.ShapeStub`):
most models read only shapes from them there (masks and rotary tables are derived from the inputs). Some feed their
*values* to every block: Gemma 3n / Gemma 4's per-layer input embeddings (``embed_tokens_per_layer`` and
``per_layer_model_projection`` run once before the loop, a slice of their sum goes to each layer), Zamba2's
embeddings concatenated to the hidden state in its shared block. Their outputs are *carried*:

- found at set-up by :func:`carried_calls`, a probe that runs no block: on each later stage the stand-ins return
  zero leaves that require grad, the stage's own blocks are only recorded (the arguments they would receive,
  besides the hidden state) and the last stage's output taken; a stand-in output any of them depends on
  (autograd) is carried — once per call of its module, in call order;
- recorded on the first stage (:class:`CarriedRecorder`: a copy of each such module's output tensors) and sent to the
  next stage after the hidden state, as one tuple ``(hidden, *carried)``; each later stage's stand-in returns the
  values it received (:meth:`~lightning_4d.pipeline.staged.ShapeStub.replay`) and sends them on; their gradients
  flow back along the pipeline like the hidden state's, to the modules that made them.

Bytes: each carried tensor crosses every stage boundary with the hidden state (for Gemma 4's per-layer inputs two
tensors of ``B·T·layers·width`` each). A value the probe misses (one a pre-block module derives without gradients,
e.g. under ``torch.no_grad``) still reads zeros: the pipeline's value check
(:func:`~lightning_4d.pipeline.checks.check_staged`) compares the stages with the plain forward and refuses it.

Example:
    >>> calls = (("emb_per_layer", 1), ("proj", 1))
    >>> describe_carried(calls)
    'emb_per_layer (1 tensor), proj (1 tensor)'
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from lightning_4d._compat import pytree

__all__ = ["CarriedCalls", "CarriedRecorder", "carried_calls", "describe_carried", "split_received", "tensor_leaves"]

#: ``((module path, tensors in its output), ...)``: one entry per call of a carried module, in call order.
CarriedCalls = tuple[tuple[str, int], ...]


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (any nesting pytree flattens), in order.

    Example:
        >>> len(tensor_leaves((torch.zeros(1), {"a": torch.ones(2)}, 3)))
        2
    """
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def describe_carried(calls: CarriedCalls) -> str:
    """One line naming the carried modules (for logs and errors).

    Example:
        >>> describe_carried((("a", 2),))
        'a (2 tensors)'
    """
    return ", ".join(f"{path} ({n} tensor{'s' if n != 1 else ''})" for path, n in calls) or "nothing"


def carried_calls(run_stage: Callable[[int], tuple[list[tuple[str, list[torch.Tensor]]], list[torch.Tensor]]],
                  num_stages: int) -> CarriedCalls:
    """Which calls of the stand-ins later stages depend on, in call order (see the module doc). ``run_stage(i)``
    runs stage ``i`` in probe mode and returns ``(stand-in calls, roots)``: per stand-in call its path and the
    leaves (requiring grad) it returned, and the tensors the stage consumes (its blocks' arguments besides the
    hidden state; the last stage's output). Every stand-in call of the first later stage that any stage depends on
    is carried (a value needed two stages on still crosses every boundary in between).

    Example:
        >>> leaf = torch.zeros(2, requires_grad=True)
        >>> carried_calls(lambda i: ([("emb", [leaf])], [leaf * 2]), 2)
        (('emb', 1),)
    """
    needed: dict[int, bool] = {}
    order: list[tuple[str, int]] = []
    for index in range(1, num_stages):
        calls, roots = run_stage(index)
        if index == 1:
            order = [(path, len(leaves)) for path, leaves in calls]
        elif [(p, len(x)) for p, x in calls] != order:
            raise ValueError(
                f"the modules before the blocks ran differently on pipeline stage {index} "
                f"({[p for p, _ in calls]}) than on stage 1 ({[p for p, _ in order]}): their outputs cannot be "
                f"carried from the first stage")
        leaves = [t for _, ts in calls for t in ts if t.requires_grad]
        roots = [r for r in roots if isinstance(r, torch.Tensor) and r.requires_grad]
        if not leaves or not roots:
            continue
        total = sum((r.float().sum() for r in roots), torch.zeros((), device=roots[0].device))
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
        used = {id(t) for t, g in zip(leaves, grads) if g is not None}
        for i, (_, ts) in enumerate(calls):
            needed[i] = needed.get(i, False) or any(id(t) in used for t in ts)
    return tuple(order[i] for i in range(len(order)) if needed.get(i, False))


class CarriedRecorder:
    """Records, on the first stage, the outputs of the carried modules' calls (a copy of each tensor: model code may
    change a module's output in place after the call; the copy is what a later stage's stand-in must return).

    Example:
        >>> emb = nn.Embedding(4, 2)
        >>> rec = CarriedRecorder({"emb": emb}, (("emb", 1),))
        >>> with rec:
        ...     _ = emb(torch.zeros(1, dtype=torch.long))
        >>> len(rec.values())
        1
    """

    def __init__(self, modules: dict[str, nn.Module], calls: CarriedCalls) -> None:
        self.calls = calls
        self._seen: Optional[list[tuple[str, list[torch.Tensor]]]] = None
        wanted = {p for p, _ in calls}
        self._modules = {p: m for p, m in modules.items() if p in wanted}
        self._handles: list[Any] = []

    def _hook(self, path: str) -> Callable[..., None]:
        def hook(_mod: nn.Module, _args: tuple, out: Any) -> None:
            if self._seen is not None:
                self._seen.append((path, [t.clone() for t in tensor_leaves(out)]))
        return hook

    def __enter__(self) -> "CarriedRecorder":
        # hooked while recording only, after any hook a rewrite added since set-up (a vocabulary-parallel
        # embedding's output is reduced by its own hook: the copy is of the reduced output)
        self._handles = [m.register_forward_hook(self._hook(p)) for p, m in self._modules.items()]
        self._seen = []
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def values(self) -> list[torch.Tensor]:
        """The recorded tensors of :attr:`calls`, flat, in call order (refuses a call pattern that differs)."""
        seen, self._seen = self._seen or [], None
        wanted = {p for p, _ in self.calls}
        got = [(p, ts) for p, ts in seen if p in wanted]
        if [(p, len(ts)) for p, ts in got] != list(self.calls):
            raise ValueError(
                f"the first pipeline stage ran the modules whose outputs later stages read as "
                f"{[(p, len(ts)) for p, ts in got]}, not as found at set-up ({list(self.calls)}): they cannot be "
                f"carried to the later stages")
        return [t for _, ts in got for t in ts]


def split_received(calls: CarriedCalls, received: Sequence[torch.Tensor]) -> dict[str, list[list[torch.Tensor]]]:
    """The tensors a later stage received after the hidden state, per carried module and call (what each stand-in
    returns, in order).

    Example:
        >>> a, b = torch.zeros(1), torch.ones(1)
        >>> {k: len(v) for k, v in split_received((("x", 1), ("y", 1)), [a, b]).items()}
        {'x': 1, 'y': 1}
    """
    expected = sum(n for _, n in calls)
    if len(received) != expected:
        raise ValueError(f"a pipeline stage received {len(received)} carried tensor(s) after the hidden state, "
                         f"expected {expected} ({describe_carried(calls)})")
    out: dict[str, list[list[torch.Tensor]]] = {}
    flat = iter(received)
    for path, n in calls:
        out.setdefault(path, []).append([next(flat) for _ in range(n)])
    return out
