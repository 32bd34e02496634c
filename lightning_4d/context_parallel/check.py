"""Set-up refusal of models context parallelism cannot split exactly, naming the module and the cause.

Three checks, before the model is rewritten for the mesh:

1. **Declared** (no forward): ALiBi (a module or attribute named ``alibi``), a position bias the local chunk's
   offsets would get wrong, and attention logit soft-capping (``attn_logit_softcapping`` on a module or its
   ``config``: Gemma 2; LitGPT's ``attention_logit_softcapping``), a ``tanh`` on the scores
   ``F.scaled_dot_product_attention`` cannot compute. (Sliding
   windows are supported: :mod:`.windows` tracks each layer's, the mask is recomputed from global positions.)
2. **Traced** (one forward of the whole model on a tiny example): attention written by hand (a ``matmul`` /
   ``softmax`` producing ``(T, T)`` scores, e.g. transformers' ``eager`` interface) instead of
   ``F.scaled_dot_product_attention``, the only call :class:`~.attention.ContextParallelAttention` makes global.
3. **Values** (models built for real): the same example run context-parallel, every module's output compared
   with its zigzag share of the whole run's; the first module that differs is named (typically positions taken
   from the local length — ``torch.arange(T)``, a learned position embedding — in a forward that takes no
   ``position_ids``). Only outputs laid out along the sequence are compared: a module handed a data-dependent
   subset of the tokens (an expert of a loop MoE, :mod:`.alignment`) is not. A buffer the whole run slices to
   ``T`` rows (a rotary table: LitGPT's ``cos[:T]``) is handed to the model in this rank's global positions during
   every context-parallel step (:mod:`.position_tables`), so such models split exactly.

Example:
    >>> import torch
    >>> class Capped(torch.nn.Module):
    ...     attn_logit_softcapping = 50.0
    >>> try:
    ...     check_declared(torch.nn.Sequential(Capped()))
    ... except UnsplittableAttention as err:
    ...     print(str(err)[:100])
    context parallelism cannot split the attention of module '0' (Capped): it caps the attention logits
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_4d.core.batches import PackedInputs, call_model
from lightning_4d.context_parallel.algorithm import AttentionHeads
from lightning_4d.context_parallel.alignment import TokenSubsets
from lightning_4d.context_parallel.attention import ContextParallelAttention, UnsplittableAttention, bind_microbatches
from lightning_4d.context_parallel.position_tables import install_position_tables, watch_sliced_tables
from lightning_4d.context_parallel.sharding import shard_batch, takes_positions
from lightning_4d.context_parallel.windows import track_windows
from lightning_4d.context_parallel.zigzag import zigzag_split
from lightning_4d.core.precision import allowed_difference, max_difference

__all__ = ["ModelInfo", "check_context_parallel", "check_declared", "declared_sliding_window", "example_length"]

_SCORE_FUNCS = {torch.matmul, torch.bmm, torch.baddbmm, torch.einsum, torch.softmax, F.softmax, torch.Tensor.softmax,
                torch.Tensor.__matmul__, torch.Tensor.matmul, torch.Tensor.bmm}


def declared_sliding_window(owner: Any) -> Optional[int]:
    """The sliding window (tokens) a module or a config declares for its attention, else ``None``.

    Example:
        >>> class Cfg:
        ...     sliding_window, layer_types = 4, ["full_attention"]
        >>> declared_sliding_window(Cfg()) is None
        True
    """
    window = getattr(owner, "sliding_window", None)
    layer_types = getattr(owner, "layer_types", None) or ()
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        if not layer_types or "sliding_attention" in layer_types:
            return window
    return None


def check_declared(module: nn.Module) -> None:
    """Refuse declared attention logit soft-capping or ALiBi, naming the module (see the module doc). Pure.

    Example:
        >>> check_declared(torch.nn.Linear(2, 2))  # nothing declared
    """
    subs = list(module.named_modules())
    # A module's own attribute first (the attention module itself), then a config (the model holding it).
    for name, sub, owner in [(n, m, m) for n, m in subs] + [(n, m, getattr(m, "config", None)) for n, m in subs]:
        if owner is None:
            continue
        whose = "it" if owner is sub else "its config"
        # transformers' ``attn_logit_softcapping``, LitGPT's ``attention_logit_softcapping``
        capping = [(a, v) for a in [*vars(owner), *vars(type(owner))]
                   if "softcap" in a and ("attn" in a or "attention" in a)
                   and isinstance(v := getattr(owner, a, None), (int, float)) and not isinstance(v, bool) and v]
        if capping:
            attr, cap = capping[0]
            raise UnsplittableAttention(
                f"context parallelism cannot split the attention of module {name!r} ({type(sub).__name__}): {whose} "
                f"caps the attention logits ({attr}={cap}: scores -> cap·tanh(scores/cap)), which "
                f"torch.nn.functional.scaled_dot_product_attention, the call made global across the cp ranks, does "
                f"not compute (transformers and LitGPT compute it by hand). Use cp=1 for this model, or a config "
                f"with {attr}=None (a different model; transformers: also attn_implementation='sdpa').")
        alibi = [a for a, v in vars(owner).items()
                 if ("alibi" in a.lower() and v not in (None, False)) or (isinstance(v, str) and v.lower() == "alibi")]
        if (owner is sub and "alibi" in type(sub).__name__.lower()) or alibi:
            raise UnsplittableAttention(
                f"context parallelism cannot split the attention of module {name!r} ({type(sub).__name__}): {whose} "
                f"uses ALiBi ({', '.join(alibi) or type(sub).__name__}), a position bias computed from the local "
                f"chunk's offsets. Use cp=1 for this model.")


_BOUND: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _bind_once(module: nn.Module) -> None:
    if module not in _BOUND:
        _BOUND.add(module)
        bind_microbatches(module)


def example_length(module: nn.Module, cp: int, tp: int = 1) -> int:
    """A sequence length for the set-up checks: a multiple of ``2·cp`` (and ``cp·tp``), at least 8, and equal to no
    dimension of any parameter (so a ``(T, T)`` tensor is attention scores, not a coincidence).

    Example:
        >>> example_length(torch.nn.Linear(8, 12), cp=2)
        16
    """
    sizes = {d for p in module.parameters() for d in p.shape}
    step = 2 * cp * tp // _gcd(2 * cp, tp)
    length = step * max(1, -(-8 // step))
    while length in sizes:
        length += step
    return length


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


@contextlib.contextmanager
def _module_names(module: nn.Module) -> Iterator[Callable[[], str]]:
    """While active, a function naming the innermost module running (``'model.layers.0.attn' (Attention)``)."""
    stack: list[str] = []

    def leave(*_: Any) -> None:  # a forward hook returning a value would replace the output
        if stack:
            stack.pop()

    handles = []
    for name, sub in module.named_modules():
        label = f"module {name or '<root>'!r} ({type(sub).__name__})"
        handles.append(sub.register_forward_pre_hook(lambda *_, label=label: stack.append(label) and None))
        handles.append(sub.register_forward_hook(leave))
    try:
        yield lambda: stack[-1] if stack else f"module '<root>' ({type(module).__name__})"
    finally:
        for handle in handles:
            handle.remove()


class _Watch(TorchFunctionMode):
    """Counts ``scaled_dot_product_attention`` calls and names modules that compute ``(T, T)`` scores otherwise."""

    def __init__(self, seq_len: int, where: Callable[[], str]) -> None:
        super().__init__()
        self.seq_len, self.where = seq_len, where
        self.sdpa = 0
        self.heads: list[AttentionHeads] = []  # (where, query heads, K/V heads, enable_gqa) of every SDPA call
        self.hand_written: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            self.sdpa += 1
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs["key"]
            if query.dim() >= 3 and key.dim() >= 3:
                gqa = bool(kwargs.get("enable_gqa", False))
                self.heads.append((self.where(), int(query.shape[-3]), int(key.shape[-3]), gqa))
        elif (func in _SCORE_FUNCS and isinstance(out, Tensor) and out.is_floating_point() and out.dim() >= 2
              and tuple(out.shape[-2:]) == (self.seq_len, self.seq_len)):
            self.hand_written.append(self.where())
        return out


def _record(module: nn.Module, outputs: dict[str, Tensor], skipped: set[str]) -> contextlib.ExitStack:
    """Every module's first floating output; a module handling a data-dependent subset of the tokens (an expert
    fed ``x[rows]``: :mod:`.alignment`) goes to ``skipped`` instead, its output being no sequence."""
    stack = contextlib.ExitStack()
    subsets = stack.enter_context(TokenSubsets())
    for name, sub in module.named_modules():
        def keep(_m: Any, inputs: Any, out: Any, name: str = name) -> None:
            if subsets.touches(inputs, out):
                skipped.add(name)
            elif isinstance(out, Tensor) and out.is_floating_point() and out.dim() >= 2 and name not in outputs:
                outputs[name] = out.detach()
        stack.callback(sub.register_forward_hook(keep).remove)
    return stack


def _first_difference(whole: dict[str, Tensor], local: dict[str, Tensor], order: list[str], seq_len: int, cp: int,
                      rank: int, skipped: set[str]) -> Optional[str]:
    for name in order:
        a, b = whole.get(name), local.get(name)
        if a is None or b is None or name in skipped:
            continue
        for dim in (0, 1):
            if a.shape[dim] == seq_len and b.shape[dim] == seq_len // cp:
                expected = zigzag_split(a, cp, rank, dim=dim)
                found = max_difference(b, expected)  # the set-up checks' one tolerance, from the dtype and scale
                if found is not None and found[0] > allowed_difference(expected, found[1]):
                    return name
                break
    return None


@dataclass(frozen=True)
class ModelInfo:
    """What the set-up check learnt: whether the model is called with ``position_ids`` (its forward takes them and
    accepts them: a wrapper may refuse them for an inner model without), its attention calls per forward and their
    head counts (:data:`~.algorithm.AttentionHeads`: what chooses the algorithm).

    Example:
        >>> ModelInfo(positions=True, attention_calls=2).positions
        True
    """

    positions: bool
    attention_calls: int
    heads: tuple[AttentionHeads, ...] = ()


def _whole_run(module: nn.Module, tokens: Tensor, watch: _Watch, outputs: dict[str, Tensor]) -> bool:
    """One forward of the whole sequence, with ``position_ids`` if the model takes them; returns whether it did."""
    seq_len = tokens.shape[1]
    if takes_positions(module):
        positions = torch.arange(seq_len, device=tokens.device)[None].expand_as(tokens)  # (B, T)
        try:
            call_model(module, PackedInputs(tokens, positions))
            return True
        except (TypeError, ValueError) as err:  # a wrapper refusing them for its inner model: called without
            if "position" not in str(err):
                raise
            outputs.clear()
            watch.sdpa, watch.hand_written, watch.heads = 0, [], []
    call_model(module, tokens)
    return False


@torch.no_grad()
def check_context_parallel(module: nn.Module, tokens: Tensor, group: Optional[dist.ProcessGroup], cp: int,
                           rank: int, values: bool = True) -> ModelInfo:
    """Run checks 1–3 of the module doc on ``module`` (the whole model, before it is rewritten) with the example
    ``tokens`` ``(B, T)`` (``T`` from :func:`example_length`); collective over the ``cp`` group when ``values``.

    Raises:
        UnsplittableAttention: naming the module and the cause.

    Example:
        >>> # not run: needs a process group
        >>> check_context_parallel(lm, torch.randint(0, 64, (2, 16)), mesh["cp"].get_group(), 2, 0)  # doctest: +SKIP
        ModelInfo(positions=True, attention_calls=2)
    """
    check_declared(module)
    track_windows(module)  # each layer's sliding window, while it runs: for this check and for training
    _bind_once(module)  # packed micro-batches under pp: their positions reach the attention of every stage
    seq_len = tokens.shape[1]
    was_training = {m: m.training for m in module.modules()}
    module.eval()  # dropout off: the two runs must see the same values
    try:
        whole: dict[str, Tensor] = {}
        skipped: set[str] = set()
        with _module_names(module) as where, _Watch(seq_len, where) as watch, _record(module, whole, skipped), \
                watch_sliced_tables(module, seq_len) as tables:
            positions = _whole_run(module, tokens, watch, whole)
        if watch.hand_written:
            raise UnsplittableAttention(
                f"context parallelism cannot split the attention of {watch.hand_written[0]}: it computes "
                f"({seq_len}, {seq_len}) attention scores itself (matmul / softmax) instead of calling "
                f"torch.nn.functional.scaled_dot_product_attention, the call made global across the cp ranks. Use "
                f"an SDPA attention (transformers: attn_implementation='sdpa'), or cp=1.")
        info = ModelInfo(positions, watch.sdpa, tuple(watch.heads))
        if not positions:  # tables sliced to the length: rows at this rank's global positions during a cp step
            install_position_tables(module, tables)
        if not values:
            return info
        order = list(whole)
        local: dict[str, Tensor] = {}
        local_inputs, _, shard = shard_batch(tokens, tokens, group, cp, rank, positions)
        with _module_names(module) as where, ContextParallelAttention(shard, where, strict=False) as attention, \
                _record(module, local, skipped):
            call_model(module, local_inputs)
        _agree(attention.errors[0] if attention.errors else None, group, "", tokens.device)
        _agree(_first_difference(whole, local, order, seq_len, cp, rank, skipped), group, _DIFFERS, tokens.device)
        return info
    finally:
        for m, mode in was_training.items():
            m.train(mode)


_DIFFERS = (
    "context parallelism changes the output of {where}, the first module to differ from the whole sequence's run on a "
    "test input: the model computes something from the local chunk alone — positions from its length "
    "(torch.arange(T), a learned position embedding called on arange(T); a buffer sliced to [:T] is handled), a "
    "cumulative op, a convolution or state across tokens. Take `position_ids` in forward and use them for positions "
    "(they are global under cp), or use cp=1.")


def _agree(problem: Optional[str], group: Optional[dist.ProcessGroup], message: str, device: torch.device) -> None:
    """Every cp rank raises if one found a ``problem`` (no rank is left waiting in the next collective): the
    ``message`` with ``{where}`` filled by the problem, or the problem itself when ``message`` is empty. The flag
    is made on ``device``, the group's."""
    flag = torch.tensor([0.0 if problem is None else 1.0], device=device)
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if float(flag) == 0.0:
        return
    if problem is None:
        raise UnsplittableAttention("context parallelism cannot split this model: another cp rank found why (see "
                                    "its error).")
    raise UnsplittableAttention(message.format(where=f"module {problem!r}") if message else problem)
