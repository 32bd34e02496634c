"""Per-head attention biases a module receives as an argument (ALiBi): found in the trace, sliced with the heads.

ALiBi models (Bloom, MPT) build one additive bias per head *outside* the attention, from the model's whole head
count, and pass it in: Bloom's ``alibi`` ``(B·H, 1, K)`` goes into ``alibi.baddbmm(q, k)``, MPT's
``position_bias`` ``(H, 1, K)`` is added to the scores ``(B, H, Q, K)``. Under tensor parallelism a rank computes
only its heads, so such an argument must be cut like them: the rank holding heads ``[lo, hi)`` gets those rows.

Found from the dataflow, not from names: during the traced forward every tensor argument of a module of the
first block (besides its main input) is labelled; the label follows the argument through layout ops (views,
slices, ``repeat``, casts) only, and an argument is a *score bias* when a labelled tensor is added
(``+``, ``baddbmm``, ``scaled_dot_product_attention``'s ``attn_mask``) to a tensor computed by the block's
linears with a non-broadcast dimension ``-3`` that is the result's dimension ``-3`` (heads: ``(B, H, Q, K)``,
or batch × heads folded: ``(B·H, Q, K)``). Rotary tables (multiplied) and masks (``(B, 1, Q, K)``: broadcast
over heads) are not. The tensor-parallel plan then keeps those whose dimension ``-3`` is a head count of the
region (or the batch times it), and :func:`install_head_inputs` cuts them per rank on the way in
(:func:`slice_heads`); the set-up comparison of the sharded with the unsharded forward checks the result.

Example:
    >>> import torch
    >>> bias = torch.arange(8.0).view(8, 1, 1)   # (B·H, 1, K) with B=2, H=4
    >>> slice_heads(bias, heads=4, lo=2, hi=4).flatten().tolist()
    [2.0, 3.0, 6.0, 7.0]
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from lightning_4d.analysis.hooks import TP_PLAN, hook_call

__all__ = ["ArgKey", "ScoreBiases", "install_head_inputs", "slice_heads"]

ArgKey = int | str  # a positional index into the call's arguments, or a keyword
# Ops through which a bias stays the same bias (its rows still the heads'); everything else ends the label.
_LAYOUT = frozenset({"view", "reshape", "__getitem__", "narrow", "expand", "expand_as", "repeat", "contiguous",
                     "clone", "to", "float", "half", "bfloat16", "double", "type_as", "unsqueeze", "squeeze",
                     "detach", "unflatten", "flatten"})
# Ops that add a bias to attention scores.
_ADDITIVE = frozenset({"add", "__add__", "__radd__", "add_", "__iadd__", "baddbmm", "scaled_dot_product_attention"})


class ScoreBiases:
    """Records, during one traced forward, which tensor arguments of which modules are added to attention scores
    along the heads' dimension (see the module doc). ``found``: ``{module path: {argument: (shape, batch)}}``, with
    the argument's shape and its call's batch size (the main input's first dimension).

    Example:
        >>> ScoreBiases().found
        {}
    """

    def __init__(self) -> None:
        self.found: dict[str, dict[ArgKey, tuple[tuple[int, ...], int]]] = {}
        # id -> (tensor kept alive, {(module, argument, shape, batch)})
        self._labels: dict[int, tuple[torch.Tensor, frozenset[tuple[str, ArgKey, tuple[int, ...], int]]]] = {}

    def label_call(self, path: str, args: tuple, kwargs: dict, main: torch.Tensor) -> None:
        """Label the tensor arguments of a call of module ``path`` other than its main input ``main`` and tensors
        shaped like it (a residual stream passed along)."""
        batch = int(main.shape[0]) if main.dim() else 0
        named: list[tuple[ArgKey, Any]] = [*enumerate(args), *kwargs.items()]
        for key, value in named:
            if isinstance(value, torch.Tensor) and value.dim() >= 3 and value.shape != main.shape:  # not a residual
                self._add(value, frozenset({(path, key, tuple(value.shape), batch)}))

    def _add(self, t: torch.Tensor, labels: frozenset) -> None:
        entry = self._labels.get(id(t))
        old = entry[1] if entry is not None and entry[0] is t else frozenset()
        self._labels[id(t)] = (t, old | labels)

    def _of(self, t: Any) -> frozenset:
        entry = self._labels.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is t else frozenset()

    def follow(self, name: str, args: tuple, kwargs: dict, out: Any, computed: Callable[[torch.Tensor], bool]) -> None:
        """After op ``name``: carry labels through layout ops; record labelled operands of an addition to a tensor
        ``computed`` says the block's linears produced (``computed(t) -> bool``)."""
        if not self._labels:
            return
        first = args[0] if args else None
        if name in _LAYOUT and isinstance(out, torch.Tensor) and self._of(first):
            self._add(out, self._of(first))
            return
        if name not in _ADDITIVE or not isinstance(out, torch.Tensor) or out.dim() < 3:
            return
        operands = [*args, *kwargs.values()]
        if not any(isinstance(t, torch.Tensor) and computed(t) for t in operands):
            return
        heads = int(out.shape[-3])
        for t in operands:
            if isinstance(t, torch.Tensor) and t.dim() >= 3 and int(t.shape[-3]) == heads != 1:
                for path, key, shape, batch in self._of(t):
                    self.found.setdefault(path, {})[key] = (shape, batch)


def slice_heads(x: torch.Tensor, heads: int, lo: int, hi: int) -> torch.Tensor:
    """Heads ``[lo, hi)`` of a per-head bias ``x`` whose dimension ``-3`` is the ``heads`` heads, or a batch × heads
    folded (batch outer, as ``alibi.repeat(B, 1, 1)`` makes it). Raises naming the sizes otherwise.

    Example:
        >>> slice_heads(torch.zeros(4, 1, 16), heads=4, lo=0, hi=2).shape
        torch.Size([2, 1, 16])
    """
    size = int(x.shape[-3])
    if size == heads:
        return x.narrow(-3, lo, hi - lo)
    if size % heads == 0:
        return x.unflatten(-3, (size // heads, heads)).narrow(-3, lo, hi - lo).flatten(-4, -3)
    raise ValueError(
        f"a per-head attention bias of shape {tuple(x.shape)} does not hold {heads} heads (or a batch times them) "
        f"along dimension -3 as it did when the model was traced"
    )


def install_head_inputs(owner: nn.Module, inputs: dict[ArgKey, tuple[int, tuple[int, int]]]) -> None:
    """During ``owner``'s forward each per-head score bias it receives (``inputs``: argument -> (heads, this
    rank's ``[lo, hi)``), ALiBi's slopes times distances: :mod:`lightning_4d.analysis.head_bias`) is cut to this rank's
    heads, as its attention scores are. A bias that requires grad is refused: its gradient would reach what made it
    as this rank's share only.

    Example:
        >>> attn = nn.Identity()
        >>> install_head_inputs(attn, {0: (4, (2, 4))})
        >>> attn(torch.arange(4.0).view(4, 1, 1)).flatten().tolist()
        [2.0, 3.0]
    """
    where = type(owner).__name__

    def cut(key: ArgKey, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        heads, (lo, hi) = inputs[key]
        if x.requires_grad:
            raise ValueError(
                f"{where}: its per-head attention bias {key!r} requires grad; tensor parallelism cuts it to this "
                f"rank's heads, so its gradient would be this rank's share only. Implement {hook_call(TP_PLAN)} "
                f"or use tp=1."
            )
        try:
            return slice_heads(x, heads, lo, hi)
        except ValueError as err:
            raise ValueError(f"{where} argument {key!r}: {err}. Use tp=1 or implement {hook_call(TP_PLAN)}.") from err

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = tuple(cut(i, a) if i in inputs else a for i, a in enumerate(args))
        return args, {k: cut(k, v) if k in inputs else v for k, v in kwargs.items()}

    owner.register_forward_pre_hook(hook, with_kwargs=True)
