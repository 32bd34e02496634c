"""Materialise only this rank's shards of a model built on the meta device, drawing only what it keeps.

The strategy rewrites a meta-built model for its layout while it is still on the meta device (pipeline
pruning, experts, TP/SP, data parallelism: no memory), then calls :func:`materialize_local_shards`:

1. ``to_empty`` allocates this rank's *local* shards only (DTensor local tensors, FSDP2 shards, this rank's
   pipeline stages).
2. The initialisers of a meta *skeleton* of the unsharded model are *recorded* in a single process's order
   (:func:`lightning_4d._compat.init_calls`: every ``reset_parameters`` in module order, then every
   ``init_weights``; a Hugging Face model's ``init_weights`` module by module, as its own ``smart_apply`` does):
   each call runs on memory-less stand-ins (:mod:`lightning_4d.materialize.init_record`) and leaves, per tensor, the region it
   writes and how (:class:`~lightning_4d.materialize.init_pieces.Step`). Each call runs with the global random state seeded
   from the run's seed and the call's label, so draws outside the tensors (a ``torch.rand`` that feeds a
   ``copy_``) are the same on every rank.
3. Each rank then computes **only its own elements**, in chunks of at most
   :data:`~lightning_4d.materialize.init_pieces.CHUNK_ELEMENTS` (:func:`lightning_4d.materialize.shard_slices.local_chunks`): random draws
   are counter-based, keyed by the run's random seed, the tensor's name and the draw's number and addressed by the element's
   position in the unsharded tensor. Set-up work and memory are the rank's share plus one chunk
   (:func:`~lightning_4d.materialize.init_pieces.scratch_bytes`).
4. A call that needs a tensor's values (``w.norm()``, ``w.data = ...``, a copy from another parameter) cannot be
   replayed piece by piece: it runs on whole tensors, one call at a time, as before, and is listed in
   :attr:`MaterializeReport.whole_calls` (logged by the strategy).
5. A tensor no initialiser wrote fails here, by name (never train on uninitialised memory).

**The rule**: a meta-built model's initial values are a function of the run's seed (a digest of the global random
state when set-up starts, the same on every rank) and the parameters' names — never of the layout. Every layout
and one process (:func:`materialize`) start from the same bits. They are *not* the values PyTorch's sequential
``reset_parameters`` would draw from the same seed (that stream depends on the order of every tensor in the
model, so a rank could not draw its part alone); the distributions are the same (``normal_``, ``uniform_``,
``trunc_normal_``, fills, fans computed from the full shape). A model built on the CPU keeps its own values.

``sync_module_states``: ranks whose random states differ (one ``all_gather_object`` of a digest) use rank 0's
seed; no tensor is sent.

Example:
    >>> from torch import nn
    >>> with torch.device("meta"):
    ...     net = nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3))
    >>> skeleton = copy.deepcopy(net)
    >>> report = materialize_local_shards(skeleton, net, torch.device("cpu"))
    >>> report.tensors, report.whole_calls, net[1].weight.tolist()
    (4, [], [1.0, 1.0, 1.0])
"""

from __future__ import annotations

import copy
import hashlib
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_4d.core.distributed import is_on_meta
from lightning_4d._compat import init_calls, release_freed_host_memory, returnable_host_empty, to_empty_keeping_ties
from lightning_4d._compat.dispatch import dispatch_mode_base
from lightning_4d.materialize.init_pieces import (
    CHUNK_ELEMENTS, Region, Step, covers, evaluate, live_steps, scratch_bytes, unwritten_fill,
)
from lightning_4d.analysis.hooks import WeightSource  # noqa: F401 - re-exported (the protocol's historical home)
from lightning_4d.materialize.init_record import Recorder, RecordingTensor
from lightning_4d.materialize.load_sources import load_sources, weight_sources
from lightning_4d.materialize.shard_slices import chunkable, local_chunks, local_of, local_slice, read_local, write_full
from lightning_4d.tensor_parallel.layouts import permutations_of

if TYPE_CHECKING:
    from torch._ops import OperatorBase

    from lightning_4d._compat import InitCall

__all__ = ["MaterializeReport", "UninitializedError", "WeightSource", "module_copy", "materialize",
           "materialize_local_shards", "meta_skeleton", "local_slice", "read_local", "write_full"]


class UninitializedError(ValueError):
    """A parameter or buffer of a meta-built model that no ``reset_parameters`` / ``init_weights`` wrote."""


@dataclass
class MaterializeReport:
    """What :func:`materialize_local_shards` did (logged by the strategy).

    Example:
        >>> MaterializeReport().largest_call_bytes
        0
    """

    tensors: int = 0  # distinct tensors of the unsharded model initialised
    calls: int = 0  # initialiser calls run
    largest_call_bytes: int = 0  # full tensors alive during the largest whole-tensor call (0: all replayed)
    largest_call: str = ""
    broadcast: bool = False  # ranks' random states differed: rank 0's seed was used
    whole_calls: list[str] = field(default_factory=list)  # "label: reason" of calls run on whole tensors
    scratch_bytes: int = 0  # the chunk working set held beyond the share while computing this rank's elements
    local_bytes: int = 0  # this rank's shards
    loaded: int = 0  # tensors read from a WeightSource instead of initialised
    loaded_in_pieces: int = 0  # of those, read in row pieces (only the rows holding this rank's elements)
    superseded_steps: int = 0  # recorded steps a later whole-tensor write overwrites: never computed


def module_copy(module: nn.Module, to_meta: bool = False) -> nn.Module:
    """A copy of ``module`` whose modules, parameters and buffers are deep copies (free on the meta device) and
    whose other attributes are shared: a LightningModule's Trainer, metrics, tokenizer or data are not copied,
    its methods (``forward``, ``loss_fn``, the ``fourd_*`` hooks) still work. Dicts (hooks) are copied shallowly,
    so hooks added to the copy leave ``module`` alone. ``torchmetrics`` metrics (no weights; a process group that
    cannot be copied) are left out. ``to_meta``: the copy's tensors are new meta tensors of the
    same shapes (a skeleton of a model built for real, without copying its memory; ties kept).

    Example:
        >>> net = nn.Linear(1, 1, device="meta"); twin = module_copy(net)
        >>> twin.weight is net.weight, twin.weight.is_meta
        (False, True)
    """
    memo: dict[int, Any] = {}
    for sub in module.modules():
        if _is_metric(sub):  # torchmetrics metrics: no weights, and a process group that cannot be copied
            memo[id(sub)] = None  # left out of the copy
    if to_meta:
        for t in list(module.parameters()) + list(module.buffers()):
            if id(t) not in memo:
                empty = torch.empty_like(t, device="meta")
                memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                    else empty
    new = copy.copy(module)
    for key, value in list(vars(module).items()):
        if key in ("_modules", "_parameters", "_buffers"):
            new.__dict__[key] = {k: copy.deepcopy(v, memo) if v is not None else None for k, v in value.items()}
        elif isinstance(value, dict):
            new.__dict__[key] = type(value)(value) if type(value) is not dict else dict(value)
        elif isinstance(value, set):
            new.__dict__[key] = set(value)
    return new


def _is_metric(module: nn.Module) -> bool:
    metric = getattr(sys.modules.get("torchmetrics"), "Metric", None)
    return metric is not None and isinstance(module, metric)


def meta_skeleton(module: nn.Module) -> nn.Module:
    """The unsharded model on the meta device, for :func:`materialize_local_shards` and the reduced check:
    :func:`module_copy` of ``module`` taken before the rewrite. Of a model built for real, every tensor becomes a
    meta tensor (no memory); of a meta-built one, the few tensors made for real (a buffer) keep their values.

    Example:
        >>> meta_skeleton(nn.Linear(1, 1, device="meta")).weight.is_meta
        True
    """
    return module_copy(module, to_meta=not is_on_meta(module))


# ---------------------------------------------------------------------------------------------- the run
_Place = tuple[Tensor, Optional[tuple[list[int], int]], Optional[int]]  # (target, TP row permutation, stack index)


@dataclass
class _Entry:
    """One distinct tensor of the skeleton, every place it goes in the rewritten model, and what the initialisers
    recorded for it since its last whole-tensor write."""

    names: list[str]
    meta: Tensor
    slots: list[tuple[nn.Module, str, bool]] = field(default_factory=list)  # (module, attribute, is_parameter)
    written: bool = False  # set by a whole-tensor call, or by a source
    steps: list[Step] = field(default_factory=list)  # to apply on top of the base (NaN, or the local values)
    defined: list[Region] = field(default_factory=list)  # regions every defining step wrote (coverage)
    base_local: bool = False  # a whole-tensor call wrote the targets: steps apply on top of their values


def _targets(sharded: nn.Module) -> dict[str, Tensor]:
    out = {n: p for n, p in sharded.named_parameters(remove_duplicate=False)}
    out.update({n: b for n, b in sharded.named_buffers(remove_duplicate=False)})
    return out


def _entries(skeleton: nn.Module) -> dict[int, _Entry]:
    """Distinct tensors of ``skeleton`` (tied weights once), with their names and module slots."""
    entries: dict[int, _Entry] = {}
    for mod_name, mod in skeleton.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr, tensor, is_param in ([(n, p, True) for n, p in mod._parameters.items()]
                                       + [(n, b, False) for n, b in mod._buffers.items()]):
            if tensor is None:
                continue
            entry = entries.setdefault(id(tensor), _Entry(names=[], meta=tensor))
            if prefix + attr not in entry.names:
                entry.names.append(prefix + attr)
            entry.slots.append((mod, attr, is_param))
    return entries


class _MetaWriteGuard(dispatch_mode_base()):  # type: ignore[misc]
    """During an initialiser call: an in-place write to a tensor still on the meta device (not one of the model's
    parameters or buffers, which are realised when read) would be lost; fail loudly instead."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def __torch_dispatch__(self, func: OperatorBase, types: tuple[type, ...], args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func._schema.is_mutable and args and isinstance(args[0], Tensor) and args[0].is_meta:
            raise RuntimeError(
                f"{self.label} writes a tensor on the meta device that is none of the model's parameters or "
                f"buffers ({func}): a reference taken when the model was built, or a scratch tensor made on meta. "
                f"lightning_4d initialises a meta-built model tensor by tensor and such a write (or random draw) "
                f"would be lost. Read parameters from their module inside the initialiser (self.weight), or build "
                f"the model on the CPU."
            )
        return func(*args, **kwargs)


def _shared_seed(sync: bool, group: Optional[dist.ProcessGroup]) -> tuple[bytes, bool]:
    """The run's seed: a digest of the global CPU random state; under ``sync`` rank 0's when the ranks of
    ``group`` differ (one ``all_gather_object``). Returns ``(seed, ranks differed)``."""
    seed = hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).digest()
    if not sync or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return seed, False
    seeds: list[Optional[bytes]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seeds, seed, group=group)
    assert seeds[0] is not None
    return seeds[0], len(set(seeds)) > 1


def _call_seed(seed: bytes, label: str) -> int:
    return int.from_bytes(hashlib.sha256(seed + b"\0call\0" + label.encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def materialize_local_shards(skeleton: nn.Module, sharded: nn.Module, device: torch.device,
                             sync_module_states: bool = False, group: Optional[dist.ProcessGroup] = None,
                             source_names: Optional[dict[str, tuple[str, Optional[int]]]] = None,
                             pretrained: bool = True) -> MaterializeReport:
    """Allocate ``sharded``'s local shards on ``device`` and fill them with the values of ``skeleton`` (the
    unsharded model, on meta) under the layout-independent rule of the module docstring, computing only this
    rank's elements.

    ``source_names``: skeleton names the rewrite renamed (``{old: (new, index or None)}``, e.g. Mixtral experts
    stacked into one tensor). ``sync_module_states``: every rank of ``group`` (default: the world) uses rank 0's
    seed even if their random states differ. ``pretrained=False``: ignore the weights the skeleton was told to
    load (its ``fourd_weight_source`` attributes, see :mod:`lightning_4d.analysis.hooks`) and initialise every tensor, as for a reduced copy
    whose shapes differ from the files.

    Raises:
        UninitializedError: naming the parameters / buffers that no initialiser wrote.

    Example:
        >>> with torch.device("meta"):
        ...     net = nn.Linear(2, 2)
        >>> materialize_local_shards(copy.deepcopy(net), net, torch.device("cpu")).calls
        1
    """
    report = MaterializeReport(scratch_bytes=scratch_bytes())
    seed, report.broadcast = _shared_seed(sync_module_states, group)
    to_empty_keeping_ties(sharded, device)
    targets = _targets(sharded)
    perms = permutations_of(sharded)
    renamed = source_names or {}
    entries = _entries(skeleton)
    report.tensors = len(entries)

    def places(entry: _Entry) -> list[_Place]:
        out: list[_Place] = []
        for name in entry.names:
            if name in targets:
                out.append((targets[name], perms.get(name), None))
            elif name in renamed and renamed[name][0] in targets:
                new, index = renamed[name]
                out.append((targets[new], perms.get(new), index))
        return out

    def write(entry: _Entry, full: Tensor) -> None:
        for target, perm, index in places(entry):
            write_full(target, full, perm, index)
        entry.written = True

    # Tensors the user created for real (not on meta) keep their values (rank 0's under sync_module_states),
    # broadcast from a copy on the device (the user may have made them on the host).
    for entry in entries.values():
        if not entry.meta.is_meta and sync_module_states and dist.is_initialized() and dist.get_world_size(group) > 1:
            value = entry.meta.detach()
            on_device = value.to(device)
            dist.broadcast(on_device, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
            if on_device is not value:
                value.copy_(on_device)

    provided = _source_provided(skeleton, entries) if pretrained else set()
    _run_calls(skeleton, entries, device, seed, places, write, provided, report)
    for key, entry in entries.items():
        if entry.meta.is_meta and key not in provided:
            _compute_local(entry, places(entry))
    if pretrained:
        by_name = {name: entry for entry in entries.values() for name in entry.names}
        report.loaded, report.loaded_in_pieces = load_sources(
            skeleton, by_name, places, write, meta_of=lambda e: e.meta,
            mark_written=lambda e: setattr(e, "written", True))

    missing = [e.names[0] for k, e in entries.items() if e.meta.is_meta and not (e.written or _covered(e))]
    if missing:
        raise UninitializedError(
            f"{type(skeleton).__name__} was built on the meta device and nothing initialised "
            f"{', '.join(missing[:8])}{' …' if len(missing) > 8 else ''} ({len(missing)} tensor(s)): no "
            f"reset_parameters() / init_weights() wrote them (or only part of them), so they would train on "
            f"uninitialised memory. Give the module owning each a reset_parameters() that fills it (e.g. "
            f"nn.init.ones_(self.weight) for a norm), or build the model on the CPU."
        )
    report.local_bytes = sum(local_of(t).numel() * local_of(t).element_size() for t in set(targets.values()))
    return report


def materialize(module: nn.Module, device: Union[str, torch.device] = "cpu", pretrained: bool = True) -> nn.Module:
    """Materialise a meta-built ``module`` in one process, in place, with the values every layout gets (the
    single-process reference of :func:`materialize_local_shards`). A module with no meta tensor is left alone.

    Example:
        >>> with torch.device("meta"):
        ...     net = nn.Linear(2, 2)
        >>> materialize(net).weight.is_meta
        False
    """
    if is_on_meta(module):
        materialize_local_shards(meta_skeleton(module), module, torch.device(device), pretrained=pretrained)
    return module


def _compute_local(entry: _Entry, places: list[_Place]) -> None:
    """Compute this rank's elements of ``entry`` from its recorded steps, a chunk at a time (nothing for a tensor
    this rank holds no part of)."""
    if not entry.steps:
        return
    shape = tuple(entry.meta.shape)
    for target, perm, index in places:
        if not chunkable(target, index):  # a stacked slice with non-shard placements: whole slice, then sliced
            full = torch.empty(shape, dtype=entry.meta.dtype)
            unwritten_fill(full)
            if entry.base_local:
                read_local(target, full, perm, index)
            evaluate(entry.steps, torch.arange(full.numel()), full.view(-1))
            write_full(target, full, perm, index)
            continue
        for chunk in local_chunks(target, shape, perm, index, CHUNK_ELEMENTS):
            if entry.base_local:
                values = chunk.get().to("cpu", copy=True)
            else:
                values = torch.empty(chunk.positions.numel(), dtype=entry.meta.dtype)
                unwritten_fill(values)
            evaluate(entry.steps, chunk.positions, values)
            chunk.put(values)


def _covered(entry: _Entry) -> bool:
    """Whether the defining steps recorded for ``entry`` wrote every element (layout-independent: from the
    regions alone; a whole-tensor region decides at once, blocks (e.g. one expert each) on the grid of their
    boundaries, anything else counted in chunks)."""
    if not entry.defined:
        return False
    if any(r.whole for r in entry.defined):
        return True
    decided = covers(entry.defined, tuple(entry.meta.shape))
    if decided is not None:
        return decided
    numel = entry.meta.numel()
    for start in range(0, numel, CHUNK_ELEMENTS):
        positions = torch.arange(start, min(start + CHUNK_ELEMENTS, numel))
        hit = torch.zeros(positions.numel(), dtype=torch.bool)
        for region in entry.defined:
            mask, _ = region.locate(positions, indices=False)
            hit |= True if mask is None else mask
        if not bool(hit.all()):
            return False
    return True


class _Slots:
    """What a module's ``_parameters`` / ``_buffers`` give for a meta tensor of the skeleton while a call runs."""

    entries: dict[int, _Entry]

    def realise(self, key: int) -> Tensor:
        raise NotImplementedError

    def settle(self, skeleton: nn.Module) -> None:
        """After the call: the skeleton's slots hold meta tensors again."""


class _Recording(_Slots):
    """A memory-less :class:`~lightning_4d.materialize.init_record.RecordingTensor` per tensor (the same object for every
    read within a call, so ``a.weight is b.weight`` holds for tied weights)."""

    def __init__(self, entries: dict[int, _Entry], recorder: Recorder) -> None:
        self.entries, self.recorder = entries, recorder
        self.made: dict[int, Tensor] = {}

    def realise(self, key: int) -> Tensor:
        if key not in self.made:
            entry = self.entries[key]
            value = self.recorder.tensor(key, entry.meta, parameter=isinstance(entry.meta, nn.Parameter))
            for mod, attr, is_param in entry.slots:
                dict.__setitem__(mod._parameters if is_param else mod._buffers, attr, value)
            self.made[key] = value
        return self.made[key]

    def settle(self, skeleton: nn.Module) -> None:
        for mod in skeleton.modules():  # the call may have assigned a stand-in elsewhere (a re-tie)
            for slots in (mod._parameters, mod._buffers):
                for attr, value in list(dict.items(slots)):
                    if isinstance(value, RecordingTensor):
                        dict.__setitem__(slots, attr, self.entries[value._key].meta)


class _Realiser(_Slots):
    """Allocates a skeleton tensor in full when a whole-tensor call first reads it from its module, holding the
    values recorded so far (this rank's part of a base a previous whole-tensor call wrote), and writes this rank's
    part to the targets and frees it after the call — or earlier, oldest first, when the live full tensors would
    exceed ``budget`` bytes (one tensor is always allowed)."""

    def __init__(self, entries: dict[int, _Entry], device: torch.device, places: Callable[[_Entry], list[_Place]],
                 write: Callable[[_Entry, Tensor], None], budget: int) -> None:
        self.entries, self.device, self.places, self.write, self.budget = entries, device, places, write, budget
        self.live: dict[int, tuple[Tensor, Tensor]] = {}  # entry id -> (full tensor, value in the slots), oldest first
        self.live_bytes = 0
        self.call_peak = 0
        self.untrimmed = 0  # bytes of full tensors released since the heap was last trimmed

    def realise(self, key: int) -> Tensor:
        entry = self.entries[key]
        nbytes = entry.meta.numel() * entry.meta.element_size()
        if self.live_bytes + nbytes > self.budget:
            for old in [k for k in self.live if not self._referenced(k)]:  # never one the caller still holds
                if self.live_bytes + nbytes <= self.budget:
                    break
                self.release(old)
        full = returnable_host_empty(entry.meta.shape, entry.meta.dtype) if self.device.type == "cpu" \
            else torch.empty(entry.meta.shape, dtype=entry.meta.dtype, device=self.device)
        unwritten_fill(full)  # NaN / the smallest integer: tells an untouched tensor from a written one
        where = self.places(entry)
        if entry.base_local and where:
            read_local(where[0][0], full, where[0][1], where[0][2])  # a later call sees the earlier one's values
        if entry.steps:
            flat = full.view(-1)
            for start in range(0, flat.numel(), CHUNK_ELEMENTS):
                part = flat[start:start + CHUNK_ELEMENTS].cpu()
                evaluate(entry.steps, torch.arange(start, start + part.numel()), part)
                flat[start:start + part.numel()] = part.to(flat.device)
        value = nn.Parameter(full, requires_grad=entry.meta.requires_grad) if isinstance(entry.meta, nn.Parameter) \
            else full
        for mod, attr, is_param in entry.slots:
            dict.__setitem__(mod._parameters if is_param else mod._buffers, attr, value)
        self.live[key] = (full, value)
        self.live_bytes += nbytes
        self.call_peak = max(self.call_peak, self.live_bytes)
        return value

    def _referenced(self, key: int) -> bool:
        """Whether code outside the module slots holds the realised value (writes to it must not be lost)."""
        return sys.getrefcount(self.live[key][1]) > 2 + len(self.entries[key].slots)  # argument, self.live, slots

    def release(self, key: int) -> None:
        entry, (full, _) = self.entries[key], self.live.pop(key)
        self.live_bytes -= entry.meta.numel() * entry.meta.element_size()
        now = _current(entry)
        for mod, attr, is_param in entry.slots:
            dict.__setitem__(mod._parameters if is_param else mod._buffers, attr, entry.meta)
        if now is not None and not now.is_meta and (entry.written or entry.steps or entry.base_local
                                                    or _was_written(now, full)):
            self.write(entry, now.detach())  # this rank's part; the steps so far are in it
            entry.steps, entry.base_local = [], True
        del now, full
        if self.device.type == "cpu":  # the writes' transients left at the C heap's top, before the next big tensor
            self.untrimmed += entry.meta.numel() * entry.meta.element_size()
            if self.untrimmed >= _TRIM_EVERY_BYTES:
                release_freed_host_memory()
                self.untrimmed = 0

    def settle(self, skeleton: nn.Module) -> None:
        while self.live:
            self.release(next(iter(self.live)))


class _LazySlots(dict):  # type: ignore[type-arg]
    """A module's ``_parameters`` / ``_buffers`` whose meta tensors are realised when read."""

    slots: _Slots

    def _value(self, value: Optional[Tensor]) -> Optional[Tensor]:
        if isinstance(value, Tensor) and value.is_meta and id(value) in self.slots.entries:
            return self.slots.realise(id(value))
        return value

    def __getitem__(self, key: str) -> Optional[Tensor]:
        return self._value(dict.__getitem__(self, key))

    def get(self, key: str, default: Optional[Tensor] = None) -> Optional[Tensor]:
        return self._value(dict.get(self, key, default))

    def items(self) -> list[tuple[str, Optional[Tensor]]]:  # type: ignore[override]
        return [(k, self._value(v)) for k, v in list(dict.items(self))]

    def values(self) -> list[Optional[Tensor]]:  # type: ignore[override]
        return [self._value(v) for v in list(dict.values(self))]


@contextmanager
def _lazy_slots(skeleton: nn.Module, slots: _Slots) -> Iterator[None]:
    swapped: list[tuple[nn.Module, str, dict[str, Optional[Tensor]]]] = []
    try:
        for mod in skeleton.modules():
            for attr in ("_parameters", "_buffers"):
                original = mod.__dict__[attr]
                lazy = _LazySlots(original)
                lazy.slots = slots
                mod.__dict__[attr] = lazy
                swapped.append((mod, attr, original))
        try:
            yield
        finally:
            slots.settle(skeleton)
    finally:
        for mod, attr, original in swapped:
            lazy = mod.__dict__[attr]
            original.clear()
            original.update(dict.items(lazy))
            mod.__dict__[attr] = original


def _real_tensors(call: InitCall) -> list[tuple[Tensor, Tensor]]:
    """``(tensor, copy)`` of the real (not meta) tensors ``call`` may write, to undo a recording attempt."""
    modules = call.module.modules() if call.recurse else [call.module]
    seen: dict[int, Tensor] = {}
    for m in modules:
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None and not t.is_meta:
                seen[id(t)] = t
    return [(t, t.detach().clone()) for t in seen.values()]


def _run_calls(skeleton: nn.Module, entries: dict[int, _Entry], device: torch.device, seed: bytes,
               places: Callable[[_Entry], list[_Place]], write: Callable[[_Entry, Tensor], None],
               provided: set[int], report: MaterializeReport) -> None:
    """Record every initialiser of ``skeleton`` in a single process's order (see the module docstring); a call
    that cannot be recorded runs on whole tensors. A call whose tensors all come from a ``fourd_weight_source`` is
    skipped (their values would be overwritten: pretrained weights are not drawn first)."""
    names = {key: entry.names[0] for key, entry in entries.items()}
    draws: dict[int, int] = {}
    largest = max((e.meta.numel() * e.meta.element_size() for e in entries.values()), default=0)
    for call in [c for c in init_calls(skeleton) if not _all_provided(c, provided)]:
        report.calls += 1
        real = _real_tensors(call)
        recorder = Recorder(seed, names, device, draws=dict(draws))
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_call_seed(seed, call.label))
                with _lazy_slots(skeleton, _Recording(entries, recorder)), recorder.recording(), \
                        _MetaWriteGuard(call.label):
                    call.fn()
        except Exception as exc:  # noqa: BLE001 - any failure: run the call for real (a real error re-raises)
            reason = str(exc).split("\n")[0][:200]
        else:
            for key, steps in recorder.steps.items():
                entry = entries[key]
                live = live_steps([*entry.steps, *steps])
                report.superseded_steps += len(entry.steps) + len(steps) - len(live)
                entry.steps = live
                if live[0].defines and live[0].region.whole:
                    entry.base_local = False  # the values a whole-tensor call left are overwritten too
                entry.defined.extend(s.region for s in steps if s.defines)
            draws = recorder.draws
            continue
        for tensor, before in real:  # undo what the attempt wrote to real tensors
            tensor.copy_(before)
        del real
        report.whole_calls.append(f"{call.label}: {reason}")
        realiser = _Realiser(entries, device, places, write, max(largest, _MIN_BUDGET))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_call_seed(seed, call.label))
            with _lazy_slots(skeleton, realiser), _MetaWriteGuard(call.label):
                call.fn()
        if realiser.call_peak > report.largest_call_bytes:
            report.largest_call_bytes, report.largest_call = realiser.call_peak, call.label
    for entry in entries.values():  # created for real by the user: a call may have changed them
        if not entry.meta.is_meta:
            write(entry, entry.meta.detach())


_TRIM_EVERY_BYTES = 8 << 20  # trim the C heap after this many bytes of full tensors were released (CPU only)
_MIN_BUDGET = 0  # full tensors kept alive together during one initialiser call beyond the largest one


def _source_provided(skeleton: nn.Module, entries: dict[int, _Entry]) -> set[int]:
    """Keys of the entries some ``fourd_weight_source`` provides."""
    by_name = {name: key for key, entry in entries.items() for name in entry.names}
    return {by_name[pre + rel] for pre, source in weight_sources(skeleton) for rel in source.names()
            if pre + rel in by_name}


def _all_provided(call: InitCall, provided: set[int]) -> bool:
    """Whether every tensor ``call`` may write (its module's, or its subtree's) comes from a weight source."""
    if not provided:
        return False
    modules = call.module.modules() if call.recurse else [call.module]
    keys = [id(t) for m in modules for t in [*m._parameters.values(), *m._buffers.values()] if t is not None]
    return bool(keys) and all(k in provided for k in keys)


def _current(entry: _Entry) -> Optional[Tensor]:
    mod, attr, is_param = entry.slots[0]
    return dict.get(mod._parameters if is_param else mod._buffers, attr)


def _was_written(now: Tensor, full: Tensor) -> bool:
    """A call wrote the tensor unless it left every element as allocated (see :func:`_fill_unwritten`)."""
    if now is not full and now.data_ptr() != full.data_ptr():
        return True  # the call assigned a new tensor
    if not now.numel() or now.dtype == torch.bool:
        return True  # nothing to tell apart: trust the call
    flat = now.reshape(-1)
    unwritten = (lambda part: torch.isnan(part).all()) if now.is_floating_point() or now.is_complex() \
        else (lambda part: (part == torch.iinfo(now.dtype).min).all())
    step = 1 << 20  # chunks: no whole-tensor mask; the first written chunk ends the scan
    return not all(bool(unwritten(flat[i:i + step])) for i in range(0, flat.numel(), step))
