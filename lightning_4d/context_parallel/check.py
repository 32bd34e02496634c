"""Set-up refusal of models context parallelism cannot split exactly, naming the module and the cause, and the
reading of each attention call's mask.

Three checks, before the model is rewritten for the mesh:

1. **Declared** (no forward): ALiBi (a module or attribute named ``alibi``), a position bias the local chunk's
   offsets would get wrong, and attention logit soft-capping (``attn_logit_softcapping`` on a module or its
   ``config``: Gemma 2; LitGPT's ``attention_logit_softcapping``), a ``tanh`` on the scores
   ``F.scaled_dot_product_attention`` cannot compute.
2. **Traced** (one forward of the whole model on a tiny example): attention written by hand (a ``matmul`` /
   ``softmax`` producing ``(T, T)`` scores, e.g. transformers' ``eager`` interface, and the eager-only families
   with attention sinks: GPT-OSS, MiMo-V2-Flash) instead of ``F.scaled_dot_product_attention``, the only call
   :class:`~.attention.ContextParallelAttention` makes global; a selection of keys by top-k over ``(T, T)`` scores
   (a sparse-attention indexer: DeepSeek-V3.2's DSA).
3. **Values** (models built for real): with every declared window, chunk and top-k shrunk below the example's
   length (:mod:`.lengths`), the mask of each attention call is read from the whole run, on one sequence and on two
   packed documents (:mod:`.probe`: what :class:`~.layer_masks.LayerMasks` gives the training step), then the same
   example runs context-parallel and every module's output laid out along the sequence is compared with its zigzag
   share of the whole run's (a module handed a data-dependent subset of the tokens, an expert of a loop MoE, is not:
   :mod:`.alignment`); the first module that differs is named (typically positions taken from the local length —
   ``torch.arange(T)``, a learned position embedding — in a forward that takes no ``position_ids``). A buffer the
   whole run slices to ``T`` rows (a rotary table: LitGPT's ``cos[:T]``) is handed to the model in this rank's
   global positions during every context-parallel step (:mod:`.position_tables`).

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
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_4d.core.batches import PackedInputs, call_model
from lightning_4d.context_parallel.algorithm import AttentionHeads
from lightning_4d.context_parallel.alignment import TokenSubsets
from lightning_4d.context_parallel.attention import ContextParallelAttention, bind_microbatches
from lightning_4d.context_parallel.layer_masks import LayerMasks
from lightning_4d.context_parallel.lengths import Shrunk, declared_lengths, shrink_map, shrunk
from lightning_4d.context_parallel.masks import MaskSpec
from lightning_4d.context_parallel.position_tables import install_position_tables, watch_sliced_tables
from lightning_4d.context_parallel.kinds import SCORES, SDPA, attention_kind
from lightning_4d.context_parallel.probe import MaskRecord, document_positions, layer_specs, read_mask
from lightning_4d.context_parallel.refusals import family_hint, refuse_traced
from lightning_4d.context_parallel.shard import UnsplittableAttention
from lightning_4d.context_parallel.sharding import shard_batch, takes_positions
from lightning_4d.context_parallel.zigzag import zigzag_split
from lightning_4d.core.precision import allowed_difference, max_difference

__all__ = ["ModelInfo", "check_context_parallel", "check_declared", "declared_sliding_window", "example_length"]


# selections along a dimension: over the keys of (T, T) scores, a sparse-attention indexer
_SELECT_FUNCS = {torch.topk, torch.Tensor.topk, torch.sort, torch.Tensor.sort, torch.argsort, torch.Tensor.argsort,
                 torch.kthvalue, torch.Tensor.kthvalue}
#: Each module's attention calls' masks, by module path (what :class:`ModelInfo` carries).
MaskTable = tuple[tuple[str, tuple[MaskSpec, ...]], ...]


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
    """A sequence length for the set-up checks: a multiple of ``2·cp`` (and ``cp·tp``), at least 8, more than twice
    every window, chunk and top-k the model declares as the check shrinks them (:mod:`.lengths`: so every one is
    crossed, also across the zigzag chunks), and equal to no dimension of any parameter (so a ``(T, T)`` tensor is
    attention scores, not a coincidence).

    Example:
        >>> example_length(torch.nn.Linear(8, 12), cp=2)
        16
    """
    sizes = {d for p in module.parameters() for d in p.shape}
    step = 2 * cp * tp // _gcd(2 * cp, tp)
    longest = max(shrink_map([v for _, _, v in declared_lengths(module)]).values(), default=0)
    length = step * max(1, -(-max(8, 2 * longest + 2) // step))
    while length in sizes:
        length += step
    return length


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


class _Where:
    """Names the innermost module running: called, its label (``module 'model.layers.0.attn' (Attention)``);
    :meth:`name`, its path in the model."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.stack: list[tuple[str, str]] = []  # (path, label)

    def __call__(self) -> str:
        return self.stack[-1][1] if self.stack else f"module '<root>' ({type(self.root).__name__})"

    def name(self) -> str:
        return self.stack[-1][0] if self.stack else ""

    def module(self) -> nn.Module:
        return self.root.get_submodule(self.name())


@contextlib.contextmanager
def _module_names(module: nn.Module) -> Iterator[_Where]:
    """While active, a :class:`_Where` naming the innermost module running."""
    where = _Where(module)

    def leave(*_: Any) -> None:  # a forward hook returning a value would replace the output
        if where.stack:
            where.stack.pop()

    handles = []
    for name, sub in module.named_modules():
        entry = (name, f"module {name or '<root>'!r} ({type(sub).__name__})")
        handles.append(sub.register_forward_pre_hook(lambda *_, entry=entry: where.stack.append(entry) and None))
        handles.append(sub.register_forward_hook(leave))
    try:
        yield where
    finally:
        for handle in handles:
            handle.remove()


class _Watch(TorchFunctionMode):
    """Counts ``scaled_dot_product_attention`` calls, names modules that compute ``(T, T)`` scores otherwise or
    select keys by top-k over them, and (``masks``) records each SDPA call's mask (:class:`~.probe.MaskRecord`)."""

    def __init__(self, seq_len: int, where: _Where, masks: bool = False) -> None:
        super().__init__()
        self.seq_len, self.where, self.read_masks = seq_len, where, masks
        self.sdpa = 0
        self.heads: list[AttentionHeads] = []  # (where, query heads, K/V heads, enable_gqa) of every SDPA call
        self.hand_written: list[str] = []
        self.selections: list[str] = []
        self.masks: list[MaskRecord] = []

    def reset(self) -> None:
        self.sdpa, self.heads, self.hand_written, self.selections, self.masks = 0, [], [], [], []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = attention_kind(func)
        if kind == SDPA:
            self.sdpa += 1
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs["key"]
            if query.dim() >= 3 and key.dim() >= 3:
                gqa = bool(kwargs.get("enable_gqa", False))
                self.heads.append((self.where(), int(query.shape[-3]), int(key.shape[-3]), gqa))
            if self.read_masks:
                mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
                causal = bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))
                allowed = read_mask(mask, causal, int(query.shape[0]), self.seq_len, self.where())
                self.masks.append(MaskRecord(self.where.name(), self.where(), allowed))
        elif (kind == SCORES and isinstance(out, Tensor) and out.is_floating_point() and out.dim() >= 2
              and tuple(out.shape[-2:]) == (self.seq_len, self.seq_len)):
            self.hand_written.append(self.where())
        elif func in _SELECT_FUNCS and args and isinstance(args[0], Tensor) and self._over_keys(func, args, kwargs):
            self.selections.append(self.where())
        return out

    def _over_keys(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether a top-k / sort selects along a sequence-long dimension of a tensor with another one: keys of
        (query, key) scores."""
        x = args[0]
        at = 2 if func in (torch.topk, torch.Tensor.topk, torch.kthvalue, torch.Tensor.kthvalue) else 1
        dim = kwargs.get("dim", args[at] if len(args) > at and isinstance(args[at], int) else -1)
        if x.dim() < 2 or not isinstance(dim, int) or x.shape[dim] != self.seq_len:
            return False
        return list(x.shape).count(self.seq_len) >= 2


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
    masks: Optional[MaskTable] = None  # each call's mask by module (the values check read it); None: not read

    def layer_masks(self, model: nn.Module) -> Optional[LayerMasks]:
        """:attr:`masks` on ``model``'s modules (the checked model, or the real one a copy was checked for)."""
        return None if self.masks is None else LayerMasks.from_names(model, dict(self.masks))


def _whole_run(module: nn.Module, tokens: Tensor, watch: _Watch, outputs: dict[str, Tensor]) -> bool:
    """One forward of the whole sequence, with ``position_ids`` if the model takes them; returns whether it did.
    A model whose second argument refuses them (a wrapper refusing them for its inner model; LitGPT's ``input_pos``,
    which wants a KV cache) is called without; if that fails too, the first error is raised."""
    seq_len = tokens.shape[1]
    if takes_positions(module):
        positions = torch.arange(seq_len, device=tokens.device)[None].expand_as(tokens)  # (B, T)
        try:
            call_model(module, PackedInputs(tokens, positions))
            return True
        except (TypeError, ValueError) as err:
            outputs.clear()
            watch.reset()
            try:
                call_model(module, tokens)
            except Exception:
                raise err from None
            return False
    call_model(module, tokens)
    return False


def _read_masks(module: nn.Module, tokens: Tensor, watch: _Watch, positions: bool,
                lengths: Shrunk) -> tuple[dict[str, tuple[MaskSpec, ...]], MaskTable]:
    """Each call's mask (:func:`~.probe.layer_specs`) from the whole run's ``watch`` and, if the model takes
    positions, one more run on two packed documents: as read (shrunk lengths, for the check's own run) and as
    declared (for training)."""
    docs_records, packed = None, None
    if positions:
        packed = document_positions(tokens.shape[0], tokens.shape[1]).to(tokens.device)  # (B, T)
        with _module_names(module) as where, _Watch(tokens.shape[1], where, masks=True) as probe:
            call_model(module, PackedInputs(tokens, packed))
        docs_records, packed = probe.masks, packed.cpu()
    read = layer_specs(watch.masks, docs_records, packed)
    declared = layer_specs(watch.masks, docs_records, packed, lengths)
    return read, tuple(declared.items())


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
    _bind_once(module)  # packed micro-batches under pp: their positions reach the attention of every stage
    was_training = {m: m.training for m in module.modules()}
    module.eval()  # dropout off: the two runs must see the same values
    try:
        with shrunk(module) if values else contextlib.nullcontext(Shrunk()) as lengths:
            return _check(module, tokens, group, cp, rank, values, lengths)
    finally:
        for m, mode in was_training.items():
            m.train(mode)


def _check(module: nn.Module, tokens: Tensor, group: Optional[dist.ProcessGroup], cp: int, rank: int, values: bool,
           lengths: Shrunk) -> ModelInfo:
    seq_len = tokens.shape[1]
    whole: dict[str, Tensor] = {}
    skipped: set[str] = set()
    problem: Optional[str] = None
    with _module_names(module) as where, _Watch(seq_len, where, masks=values) as watch, \
            _record(module, whole, skipped), watch_sliced_tables(module, seq_len) as tables:
        positions = _whole_run(module, tokens, watch, whole)
    refuse_traced(module, watch.hand_written, watch.selections, seq_len)
    info = ModelInfo(positions, watch.sdpa, tuple(watch.heads))
    if not positions:  # tables sliced to the length: rows at this rank's global positions during a cp step
        install_position_tables(module, tables)
    if not values:
        return info
    read: dict[str, tuple[MaskSpec, ...]] = {}
    try:
        read, table = _read_masks(module, tokens, watch, positions, lengths)
        info = ModelInfo(positions, watch.sdpa, tuple(watch.heads), table)
    except UnsplittableAttention as err:  # agreed over the cp ranks below, before the next collective
        problem = str(err)
    _agree(problem, group, "", tokens.device)
    order = list(whole)
    local: dict[str, Tensor] = {}
    local_inputs, _, shard = shard_batch(tokens, tokens, group, cp, rank, positions)
    masks = LayerMasks.from_names(module, read)
    with _module_names(module) as where, \
            ContextParallelAttention(shard, where, strict=False, masks=masks) as attention, \
            _record(module, local, skipped):
        call_model(module, local_inputs)
    _agree(attention.errors[0] if attention.errors else None, group, "", tokens.device)
    differs = _first_difference(whole, local, order, seq_len, cp, rank, skipped)
    _agree(differs, group, _DIFFERS + family_hint(module, differs).replace("{", "{{").replace("}", "}}"),
           tokens.device)
    return info


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
