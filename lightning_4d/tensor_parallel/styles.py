"""DTensor parallel styles for what torch's own styles do not cover.

- :class:`Colwise` / :class:`Rowwise`: torch's ``ColwiseParallel`` / ``RowwiseParallel`` extended to
  transformers' ``Conv1D`` (GPT-2: weight stored ``[in, out]``) and to fused projections whose output
  is *concatenated* (``q|k|v``): their output rows are permuted so that rank ``r``'s contiguous shard
  holds ``q_r|k_r|v_r`` (see :mod:`lightning_4d.tensor_parallel.layouts`).
- :class:`RegionInput`: the input of an attention / MLP region, gathered to a replicated DTensor, whether
  the block passes it positionally or by keyword (``self.self_attn(hidden_states=...)``).
- :func:`install_sequence_boundary`: sequence parallelism lives inside the blocks: the first block cuts
  the full sequence into this rank's shard, the last one gathers it again, so code around the blocks
  (rotary tables, masks, ``view(output_shape)``) sees the full sequence.

Example:
    >>> from torch import nn
    >>> linear_features(nn.Linear(2, 3))
    (2, 3)
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightning_4d._compat import tensor_slots
from lightning_4d.analysis.hooks import TP_PLAN, hook_call
from lightning_4d.analysis.layer_kinds import is_conv1d
from lightning_4d.analysis.trace import HiddenArg, first_param_name

__all__ = ["Colwise", "Rowwise", "RegionInput", "GatheredColumns", "DistributedNorm", "install_sequence_boundary",
           "install_head_slices", "install_head_lists", "install_row_views", "fresh_local", "linear_features",
           "head_axis"]


def linear_features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a linear or ``Conv1D``."""
    w = module.weight
    return (int(w.shape[0]), int(w.shape[1])) if is_conv1d(module) else (int(w.shape[1]), int(w.shape[0]))


class _FreshLocal(torch.autograd.Function):
    """A DTensor's local tensor as a fresh autograd leaf of the graph (not a view): the model may modify it in
    place (``mlp_output += attention_output``), which torch forbids on the view ``DTensor.to_local()`` returns."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.spec = (x.device_mesh, x.placements, x.shape, x.stride())
        return x.to_local()  # grad mode is off here: the local tensor itself, no view

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        mesh, placements, shape, stride = ctx.spec
        # The gradient may arrive laid out otherwise (attention's ``bmm(q, k.transpose(1, 2))`` on a projection's
        # output hands back a transposed one): the DTensor claims ``stride``, so its local tensor must have it.
        return DTensor.from_local(grad.contiguous(), mesh, placements, run_check=False, shape=shape, stride=stride)


def fresh_local(x: Any) -> Any:
    """``x.to_local()`` for a DTensor, as a tensor the model may modify in place; anything else unchanged.

    Example:
        >>> fresh_local(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    return _FreshLocal.apply(x) if isinstance(x, DTensor) else x


def _to_fresh_local(_mod: nn.Module, _inputs: tuple, out: DTensor) -> torch.Tensor:
    return fresh_local(out)


def _sequence(x: torch.Tensor) -> Shard:
    """The token dimension of an activation ``(B, T, H)`` or ``(B·T, H)``: the one before the features."""
    return Shard(max(x.dim() - 2, 0))


def _param(module: nn.Module, name: str, tensor: DTensor) -> None:
    old = getattr(module, name)
    module.register_parameter(name, nn.Parameter(tensor, requires_grad=old.requires_grad))


class _Sharded(ParallelStyle):
    """Column or row parallel for a linear or ``Conv1D``: torch's own style for a plain ``nn.Linear``, the
    same math with public DTensor calls for ``Conv1D`` or permuted output rows."""

    column = True

    def __init__(self, *, permutation: Optional[Sequence[int]] = None, output_layouts: Optional[Placement] = None,
                 partial_input: bool = False, sequence: bool = False) -> None:
        super().__init__()
        self.permutation = list(permutation) if permutation is not None else None
        self.output_layouts = output_layouts if output_layouts is not None else Replicate()
        self.partial_input = partial_input
        self.sequence = sequence  # a linear held by the block under SP: tokens sharded (column in, row out)

    def _partition(self, _name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        out_dim, in_dim = (1, 0) if is_conv1d(module) else (0, 1)
        for pname in ("weight", "bias"):
            p = getattr(module, pname, None)
            if p is None:
                continue
            data = p.detach()
            along = out_dim if pname == "weight" else 0
            if self.column and self.permutation is not None:
                data = data.index_select(along, torch.tensor(self.permutation, device=data.device))
            if self.column:
                placement: Placement = Shard(along)
            else:
                placement = Shard(in_dim) if pname == "weight" else Replicate()
            _param(module, pname, distribute_tensor(data, mesh, [placement]))

    def _inputs(self, _mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if self.column and self.partial_input and not isinstance(x, DTensor):
            x = _ReplicatedKeepPartialGrad.apply(x, mesh)  # (B, T, r) latent; its gradient stays a partial sum
        elif self.column:  # the full input on every rank
            layout = _sequence(x) if self.sequence else Replicate()
            x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [layout], run_check=False)
            x = x.redistribute(placements=[Replicate()]) if x.placements != (Replicate(),) else x
        else:  # this rank's slice of the input features
            x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(-1)], run_check=False)
        return (x,) + tuple(inputs[1:])

    def _outputs(self, _mod: nn.Module, out: DTensor, _mesh: DeviceMesh) -> torch.Tensor:
        if not self.column:  # partial sums: all-reduce, or reduce-scatter along the sequence (SP)
            out = out.redistribute(placements=[_sequence(out) if self.sequence else self.output_layouts])
        return fresh_local(out)

    def _torch_style(self, module: nn.Module) -> ParallelStyle:
        from lightning_4d.speed.float8 import float8_tp_style

        float8 = float8_tp_style(module, self.column, self.output_layouts)  # torchao's, for a Float8Linear
        if float8 is not None:
            return float8
        if self.column:
            return ColwiseParallel(use_local_output=False)
        return RowwiseParallel(output_layouts=self.output_layouts, use_local_output=False)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear) and self.permutation is None and not self.partial_input \
                and not self.sequence:
            parallelize_module(module, device_mesh, self._torch_style(module))
            module.register_forward_hook(_to_fresh_local)  # torch's style would return a view
            return module
        return distribute_module(module, device_mesh, self._partition, self._inputs, self._outputs)


class _ReplicatedKeepPartialGrad(torch.autograd.Function):
    """A replicated local tensor as a DTensor; in the backward its (Partial) gradient is returned *unreduced*."""

    @staticmethod
    def forward(ctx, x, mesh):  # type: ignore[override]
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if isinstance(grad, DTensor):
            if any(isinstance(p, Partial) for p in grad.placements):
                return grad.to_local(), None
            return grad.to_local() / grad.device_mesh.size(), None  # a replicated total, as an equal share
        return grad, None


class LowRankDown(ParallelStyle):
    """A low-rank down-projection inside a tensor-parallel region (DeepSeek's ``kv_a_proj_with_mqa``,
    ``q_a_proj``): kept whole and replicated. It runs on the region's gathered input as a local tensor; what it
    feeds (a norm, the column-parallel up-projection, a rotary key shared by this rank's heads) sends back only
    this rank's heads' share of the gradient, so its input gradient is returned as a ``Partial`` and its weight
    gradients are summed over ``tp`` by the strategy (like per-head norms').

    Example:
        >>> LowRankDown()  # doctest: +ELLIPSIS
        <...LowRankDown object at ...>
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_local(_mod: nn.Module, args: tuple) -> tuple:
            x = args[0]
            if isinstance(x, DTensor):
                x = x.redistribute(placements=[Replicate()]) if x.placements != (Replicate(),) else x
                x = x.to_local(grad_placements=[Partial()])  # (B, T, H)
            return (x,) + tuple(args[1:])

        module.register_forward_pre_hook(to_local)
        return module


class Colwise(_Sharded):
    """Column parallel (output features split) for ``nn.Linear`` and ``Conv1D``; ``permutation`` reorders the
    output rows first (concatenated fused outputs, see :mod:`lightning_4d.tensor_parallel.layouts`);
    ``partial_input``: the input is a replicated low-rank latent whose gradient must stay a per-rank partial sum
    (see :class:`LowRankDown`); ``sequence``: a linear held by the block itself under SP, whose input is this
    rank's tokens (gathered here, the module having no region that gathers them).

    Example:
        >>> Colwise(permutation=[0, 2, 1, 3]).permutation
        [0, 2, 1, 3]
    """

    column = True


class Rowwise(_Sharded):
    """Row parallel (input features split, bias replicated) for ``nn.Linear`` and ``Conv1D``; the partial
    outputs are reduced to ``output_layouts`` (``Replicate()``, or ``Shard(1)`` under SP), or with ``sequence``
    reduce-scattered along the token dimension whatever the output's rank (``(B·T, H)``: ``Shard(0)``).

    Example:
        >>> Rowwise().output_layouts == Replicate()
        True
    """

    column = False


def _replicated_local(x: torch.Tensor) -> torch.Tensor:
    """A region's (replicated) input as this rank's local tensor whose gradient is this rank's partial sum."""
    if isinstance(x, DTensor):
        x = x.redistribute(placements=[Replicate()]) if x.placements != (Replicate(),) else x
        return x.to_local(grad_placements=[Partial()])
    return x


class _Swap:
    """Replace some parameters of a module by views of them (``{name: fn(param)}``) from its forward pre-hook to its
    forward hook, through :func:`lightning_4d._compat.swapped_parameters`."""

    def __init__(self, module: nn.Module, views: dict[str, Callable[[nn.Parameter], torch.Tensor]]) -> None:
        import contextlib

        from lightning_4d._compat import swapped_parameters

        self.views, self.stack = views, contextlib.ExitStack()
        self._swapped = swapped_parameters

    def enter(self, module: nn.Module) -> None:
        self.stack.close()
        tensors = {name: fn(getattr(module, name)) for name, fn in self.views.items()}
        self.stack.enter_context(self._swapped(module, tensors))

    def leave(self) -> None:
        self.stack.close()


class GatheredColumns(ParallelStyle):
    """A column projection whose output holds heads that cannot be split over the ranks (one KV head of a
    multi-query model; KV heads fewer than ``tp``): its weight stays whole and replicated, and each rank computes
    only the output features its heads use (``rows[rank]``: its query heads' slice and the KV head those share).
    Each rank's gradient is a partial sum over its heads: the input gradient is returned as a ``Partial`` (reduced
    once with the region's others), the weight's is summed over ``tp`` once per step by the strategy.

    Example:
        >>> GatheredColumns([[0, 1, 4], [2, 3, 4]]).rows[1]
        [2, 3, 4]
    """

    def __init__(self, rows: Sequence[Sequence[int]]) -> None:
        super().__init__()
        self.rows = [list(r) for r in rows]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        idx = torch.tensor(self.rows[device_mesh.get_local_rank()])
        out_dim = 1 if is_conv1d(module) else 0
        views = {"weight": lambda p: p.index_select(out_dim, idx.to(p.device))}
        if getattr(module, "bias", None) is not None:
            views["bias"] = lambda p: p.index_select(0, idx.to(p.device))
        swap = _Swap(module, views)

        def pre(mod: nn.Module, args: tuple) -> tuple:
            swap.enter(mod)
            return (_replicated_local(args[0]),) + tuple(args[1:])

        def post(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            swap.leave()
            return out

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module


class DistributedNorm(ParallelStyle):
    """A norm over the full output width of a column projection (OLMo 2's ``q_norm`` over every head), run on that
    width split over the ranks: its weight (and bias) are sharded like the features, its input is this rank's
    features and DTensor computes the statistics over all of them (a sum of squares all-reduced over ``tp``). A gate
    of the input's shape (Mamba-2's gated norm, ``norm(x, gate)``, positional or keyword) is this rank's features
    too.

    Example:
        >>> DistributedNorm()  # doctest: +ELLIPSIS
        <...DistributedNorm object at ...>
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                _param(mod, pname, distribute_tensor(p.detach(), mesh, [Shard(0)]))

        def inputs(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            # The input, and a gate of the same shape (a gated norm's ``norm(x, gate)``): this rank's features.
            shape = args[0].shape if args and isinstance(args[0], torch.Tensor) else None

            def shard(x: Any) -> Any:
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.shape == shape:
                    return DTensor.from_local(x, device_mesh, [Shard(x.dim() - 1)], run_check=False)
                return x

            return tuple(shard(a) for a in args), {k: shard(v) for k, v in kwargs.items()}

        def outputs(_mod: nn.Module, out: Any, _mesh: DeviceMesh) -> Any:
            if isinstance(out, DTensor):
                last = Shard(out.dim() - 1)
                out = out.redistribute(placements=[last]) if out.placements != (last,) else out
            return fresh_local(out)

        module = distribute_module(module, device_mesh, partition, None, outputs)
        module.register_forward_pre_hook(inputs, with_kwargs=True)
        return module


def head_axis(shape: Sequence[int]) -> int:
    """The dimension a per-head parameter counts its heads along: 0, or for a broadcast shape whose first dimension
    is 1 the one dimension that is not (Kimi-Linear's ``A_log`` of shape ``(1, 1, heads, 1)``).

    Example:
        >>> head_axis((4,)), head_axis((4, 8)), head_axis((1, 1, 4, 1)), head_axis((1, 4, 8))
        (0, 0, 2, 0)
    """
    rest = [i for i, s in enumerate(shape) if int(s) != 1]
    return rest[0] if len(shape) > 1 and int(shape[0]) == 1 and len(rest) == 1 else 0


def install_head_slices(owner: nn.Module, slices: dict[str, tuple[int, int]]) -> None:
    """During ``owner``'s forward its parameters named in ``slices`` (indexed by head along dim 0, e.g. attention
    sinks, or along the one non-unit dimension of a broadcast shape, see :func:`head_axis`) are this rank's heads
    ``param[lo:hi]``; the full parameters stay registered (their gradients, zero outside this rank's heads, are
    summed over ``tp`` by the strategy).

    Example:
        >>> attn = nn.Module(); attn.sinks = nn.Parameter(torch.arange(4.0))
        >>> install_head_slices(attn, {"sinks": (2, 4)})
    """
    views = {name: (lambda p, lo=lo, hi=hi: p.narrow(head_axis(p.shape), lo, hi - lo))
             for name, (lo, hi) in slices.items()}
    swap = _Swap(owner, views)
    owner.register_forward_pre_hook(lambda mod, _args: swap.enter(mod))
    owner.register_forward_hook(lambda _mod, _args, _out: swap.leave())


def install_row_views(owner: nn.Module, rows: dict[str, Sequence[int]]) -> None:
    """During ``owner``'s forward each parameter named in ``rows`` (a path inside ``owner``, e.g. ``conv1d.weight``)
    is its rows ``param[rows]`` along dim 0, whether the model calls the module holding it or reads the parameter
    itself (Mamba-2 passes ``self.conv1d.weight`` to its convolution function); the full parameters stay registered
    (their gradients, zero outside this rank's rows, are summed over ``tp`` by the strategy). A buffer named there
    (a per-feature scale ``(1, 1, W)``, Falcon-H1's ``mup_vector``) is cut along its last dimension instead.

    Example:
        >>> owner = nn.Module(); owner.conv = nn.Conv1d(4, 4, 2, groups=4)
        >>> install_row_views(owner, {"conv.weight": [0, 3], "conv.bias": [0, 3]})
    """
    by_module: dict[str, dict[str, Callable[[nn.Parameter], torch.Tensor]]] = {}
    buffers: list[tuple[str, str, torch.Tensor]] = []
    for path, idx in rows.items():
        sub, _, pname = path.rpartition(".")
        index = torch.tensor(list(idx), dtype=torch.long)
        if pname in tensor_slots(owner.get_submodule(sub), parameters=False):
            buffers.append((sub, pname, index))
            continue
        by_module.setdefault(sub, {})[pname] = lambda p, index=index: p.index_select(0, index.to(p.device))
    swaps = [(sub, _Swap(owner.get_submodule(sub), views)) for sub, views in by_module.items()]
    saved: list[tuple[nn.Module, str, Any]] = []

    def enter(mod: nn.Module, _args: tuple) -> None:
        for sub, swap in swaps:
            swap.enter(mod.get_submodule(sub))
        for sub, name, index in buffers:
            holder = mod.get_submodule(sub)
            full = tensor_slots(holder, parameters=False)[name]
            saved.append((holder, name, full))
            if full is not None:
                tensor_slots(holder, parameters=False)[name] = full.index_select(full.dim() - 1, index.to(full.device))

    def leave(_mod: nn.Module, _args: tuple, _out: Any) -> None:
        for _, swap in swaps:
            swap.leave()
        while saved:
            holder, name, full = saved.pop()
            tensor_slots(holder, parameters=False)[name] = full

    owner.register_forward_pre_hook(enter)
    owner.register_forward_hook(leave)


class _HeadView:
    """Mixin swapped into a per-head ``ModuleList`` (see :func:`install_head_lists`): while ``_fourd_view`` is set,
    iterating, ``len`` and indexing see only this rank's heads."""

    _fourd_view: Optional[tuple[int, int]] = None

    def _fourd_visible(self) -> list[nn.Module]:
        mods = list(super().__iter__())  # type: ignore[misc]
        return mods if self._fourd_view is None else mods[self._fourd_view[0]:self._fourd_view[1]]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._fourd_visible())

    def __len__(self) -> int:
        return len(self._fourd_visible())

    def __getitem__(self, idx: Union[int, slice]) -> nn.Module:
        if self._fourd_view is None:
            return super().__getitem__(idx)  # type: ignore[misc]
        seen = self._fourd_visible()
        return nn.ModuleList(seen[idx]) if isinstance(idx, slice) else seen[idx]


_HEAD_VIEW_CLASSES: dict[type, type] = {}


def install_head_lists(owner: nn.Module, lists: dict[str, tuple[int, int]]) -> None:
    """During ``owner``'s forward each per-head module list it holds (``lists``: child name -> this rank's heads
    ``[lo, hi)``; StableLM's ``norms`` zipped with the heads) shows only those heads, so ``zip(self.norms, heads)``
    pairs every head with its own module. All modules stay registered (same names, replicated); the unused ones get
    zero gradients, and every gradient is summed over ``tp`` by the strategy.

    Example:
        >>> owner = nn.Module(); owner.norms = nn.ModuleList(nn.LayerNorm(2) for _ in range(4))
        >>> install_head_lists(owner, {"norms": (2, 4)})
    """
    unused: list[nn.Module] = []  # the other heads' modules (their parameters read at each call: FSDP swaps them)
    for name, (lo, hi) in lists.items():
        mods = owner.get_submodule(name)
        unused += [m for i, m in enumerate(mods) if not lo <= i < hi]
        cls = type(mods)
        if cls not in _HEAD_VIEW_CLASSES:
            _HEAD_VIEW_CLASSES[cls] = type(f"PerHead{cls.__name__}", (_HeadView, cls), {"__module__": cls.__module__})
        mods.__class__ = _HEAD_VIEW_CLASSES[cls]

    def enter(mod: nn.Module, _args: tuple) -> None:
        for name, span in lists.items():
            mod.get_submodule(name)._fourd_view = span

    def leave(mod: nn.Module, _args: tuple, out: Any) -> Any:
        for name in lists:
            mod.get_submodule(name)._fourd_view = None
        params = [p for m in unused for p in m.parameters()]
        if params and isinstance(out, torch.Tensor) and out.requires_grad:
            # zero gradients for the other heads' modules, so every rank sums the same tensors over tp
            out = out + sum(p.reshape(-1)[0] * 0 for p in params).to(out.dtype)
        return out

    owner.register_forward_pre_hook(enter)
    owner.register_forward_hook(leave)


class RegionInput(ParallelStyle):
    """Gather a region's main input (first argument, positional or keyword) to a replicated DTensor.

    A local tensor is taken as this rank's sequence shard (``sequence_parallel``) or as the full
    replicated activation; one DTensor feeds every column projection of the region, so their input
    gradients are reduced once. ``rows``: parameters inside the region (``{"conv1d.weight": rows per rank}``, a
    depthwise convolution's channels) that this rank uses only in part during the region's forward: they stay whole
    and replicated, the region sees ``param[rows[rank]]`` (see :func:`install_row_views`).

    Example:
        >>> RegionInput(sequence_parallel=True).sequence_parallel
        True
    """

    def __init__(self, sequence_parallel: bool, rows: Optional[dict[str, list[list[int]]]] = None) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.rows = dict(rows or {})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.rows:
            rank = device_mesh.get_local_rank()
            install_row_views(module, {name: rows[rank] for name, rows in self.rows.items()})
        keyword = first_param_name(module)
        layout = Shard(1) if self.sequence_parallel else Replicate()

        def to_replicated(x: Any) -> Any:
            if isinstance(x, DTensor):
                return x.redistribute(placements=[Replicate()]) if x.placements != (Replicate(),) else x
            if isinstance(x, torch.Tensor):
                return DTensor.from_local(x, device_mesh, [layout], run_check=False).redistribute(
                    placements=[Replicate()])
            return x

        def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (to_replicated(args[0]),) + tuple(args[1:]), kwargs
            if keyword is not None and keyword in kwargs:
                return args, {**kwargs, keyword: to_replicated(kwargs[keyword])}
            raise ValueError(
                f"tensor-parallel region {type(module).__name__} was called without its input "
                f"({keyword!r}); implement {hook_call(TP_PLAN)} for this model."
            )

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def install_sequence_boundary(first: Optional[nn.Module], last: Optional[nn.Module], hidden: HiddenArg,
                              tp_mesh: DeviceMesh) -> None:
    """Sequence parallelism between the blocks only: ``first`` takes the full hidden state and keeps this
    rank's sequence shard ``(B, T/tp, H)`` (its backward all-gathers the gradient); ``last`` returns the
    full sequence again (an all-gather; its backward keeps the local part of the replicated gradient).
    Either may be ``None`` (not on this pipeline stage).

    Example:
        >>> # not run: needs a process group
        >>> install_sequence_boundary(model.layers[0], model.layers[-1], HiddenArg(), mesh["tp"])  # doctest: +SKIP
    """

    def scatter(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        full = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)  # (B, T, H)
        return full.redistribute(placements=[Shard(1)]).to_local()  # (B, T/tp, H)

    def gather(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        shard = DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False)  # (B, T/tp, H)
        # to_local() is an autograd view; a block (FSDP2 unit) must not return one: an in-place op on it
        # would skip FSDP2's pre-backward hook. One copy of (B, T, H) per micro-batch.
        return shard.redistribute(placements=[Replicate()]).to_local().clone()  # (B, T, H)

    def enter(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return hidden.replace(args, kwargs, scatter(hidden.get(args, kwargs)))

    def leave(_mod: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> Any:
        if hidden.tuple_out is None:
            return gather(out)
        return (gather(out[0]),) + tuple(out[1:])

    if first is not None:
        first.register_forward_pre_hook(enter, with_kwargs=True)
    if last is not None:
        last.register_forward_hook(leave, with_kwargs=True)
