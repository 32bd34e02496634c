"""Materialise only this rank's shards of a model built on the meta device.

The strategy rewrites a meta-built model for its layout while it is still on the meta device (pipeline
pruning, experts, TP/SP, data parallelism: no memory), then calls :func:`materialize_local_shards`:

1. ``to_empty`` allocates this rank's *local* shards only (DTensor local tensors, FSDP2 shards, this rank's
   pipeline stages).
2. The initialisers of a meta *skeleton* of the unsharded model run in the order a single process runs them
   (:func:`lightning_4d._compat.init_calls`: every ``reset_parameters`` in module order, then every
   ``init_weights``; a Hugging Face model's ``init_weights`` module by module, as its own ``smart_apply``
   does). Before each call the tensors it may touch are allocated in full on the host (the module's subtree;
   one module for Hugging Face), after it this rank keeps its slice of each and the full tensors are freed.
   The random stream is consumed exactly as in one process, so the values equal a single process's
   ``materialize_meta_module`` for the same seed (parity holds) and peak memory is the rank's share plus the
   tensors of one initialiser call (usually one weight).
3. A tensor no initialiser wrote fails here, by name (never train on uninitialised memory).

``sync_module_states``: ranks whose random states agree (one ``all_gather_object`` of a digest) draw
identical values and need no broadcast; otherwise each full tensor is broadcast from rank 0 as it is made
(one tensor at a time, never the model).

Example:
    >>> from torch import nn
    >>> with torch.device("meta"):
    ...     net = nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3))
    >>> skeleton = copy.deepcopy(net)
    >>> report = materialize_local_shards(skeleton, net, torch.device("cpu"))
    >>> report.tensors, net[1].weight.tolist()
    (4, [1.0, 1.0, 1.0])
"""

from __future__ import annotations

import copy
import hashlib
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_4d._compat import init_calls, release_freed_host_memory, returnable_host_empty, to_empty_keeping_ties
from lightning_4d._compat.dispatch import dispatch_mode_base
from lightning_4d.hooks import WEIGHT_SOURCE, WeightSource, weight_source
from lightning_4d.shard_slices import local_of, local_slice, read_local, write_full
from lightning_4d.tensor_parallel.layouts import permutations_of

if TYPE_CHECKING:
    from torch._ops import OperatorBase

    from lightning_4d._compat import InitCall

__all__ = ["MaterializeReport", "UninitializedError", "WeightSource", "module_copy", "materialize_local_shards", "meta_skeleton", "is_meta_built",
           "local_slice", "read_local", "write_full"]


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
    largest_call_bytes: int = 0  # full tensors alive during the largest call (the set-up peak above the share)
    largest_call: str = ""
    broadcast: bool = False  # ranks' random states differed: every tensor was broadcast from rank 0
    local_bytes: int = 0  # this rank's shards
    loaded: int = 0  # tensors read from a WeightSource instead of initialised


def is_meta_built(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device.

    Example:
        >>> is_meta_built(nn.Linear(1, 1))
        False
    """
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


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
    return module_copy(module, to_meta=not is_meta_built(module))


# ---------------------------------------------------------------------------------------------- the run
@dataclass
class _Entry:
    """One distinct tensor of the skeleton and every place it goes in the rewritten model."""

    names: list[str]
    meta: Tensor
    slots: list[tuple[nn.Module, str, bool]] = field(default_factory=list)  # (module, attribute, is_parameter)
    written: bool = False


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


def _rng_digest(device: torch.device) -> str:
    state = torch.random.get_rng_state()
    if device.type == "cuda":
        state = torch.cat([state, torch.cuda.get_rng_state(device)])
    return hashlib.sha256(state.numpy().tobytes()).hexdigest()


def _rank0_rng_state(device: torch.device, group: Optional[dist.ProcessGroup]) -> Optional[list[Tensor]]:
    """Rank 0's random states when the ranks of ``group`` disagree (one ``all_gather_object`` of a digest, one
    broadcast only then); ``None`` when they agree or there is no group."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    digests: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, _rng_digest(device), group=group)
    if len(set(digests)) == 1:
        return None
    states = [torch.random.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])
    box: list[list[Tensor]] = [states]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


@contextmanager
def _random_states(states: Optional[list[Tensor]], device: torch.device) -> Iterator[None]:
    """Inside: the given random states (rank 0's); afterwards this rank's own again."""
    if states is None:
        yield
        return
    own = [torch.random.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])
    torch.random.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
    try:
        yield
    finally:
        torch.random.set_rng_state(own[0])
        if device.type == "cuda":
            torch.cuda.set_rng_state(own[1], device)


@torch.no_grad()
def materialize_local_shards(skeleton: nn.Module, sharded: nn.Module, device: torch.device,
                             sync_module_states: bool = False, group: Optional[dist.ProcessGroup] = None,
                             source_names: Optional[dict[str, tuple[str, Optional[int]]]] = None) -> MaterializeReport:
    """Allocate ``sharded``'s local shards on ``device`` and fill them with the values a single process would
    initialise ``skeleton`` (the unsharded model, on meta) to; see the module docstring.

    ``source_names``: skeleton names the rewrite renamed (``{old: (new, index or None)}``, e.g. Mixtral experts
    stacked into one tensor). ``sync_module_states``: make every rank of ``group`` (default: the world) hold
    rank 0's values even if their random states differ (broadcast per tensor only then).

    Raises:
        UninitializedError: naming the parameters / buffers that no initialiser wrote.

    Example:
        >>> with torch.device("meta"):
        ...     net = nn.Linear(2, 2)
        >>> materialize_local_shards(copy.deepcopy(net), net, torch.device("cpu")).calls
        1
    """
    report = MaterializeReport()
    rank0_states = _rank0_rng_state(device, group) if sync_module_states else None
    report.broadcast = rank0_states is not None
    to_empty_keeping_ties(sharded, device)
    targets = _targets(sharded)
    perms = permutations_of(sharded)
    renamed = source_names or {}
    entries = _entries(skeleton)
    report.tensors = len(entries)

    def placed(entry: _Entry) -> Optional[tuple[Tensor, Optional[tuple[list[int], int]], Optional[int]]]:
        for name in entry.names:
            if name in targets:
                return targets[name], perms.get(name), None
            if name in renamed and renamed[name][0] in targets:
                new, index = renamed[name]
                return targets[new], perms.get(new), index
        return None

    def write(entry: _Entry, full: Tensor) -> None:
        for name in entry.names:
            if name in targets:
                write_full(targets[name], full, perms.get(name))
            elif name in renamed and renamed[name][0] in targets:
                new, index = renamed[name]
                write_full(targets[new], full, perms.get(new), index)
        entry.written = True

    # Tensors the user created for real (not on meta) keep their values (rank 0's under sync_module_states).
    for entry in entries.values():
        if not entry.meta.is_meta and sync_module_states and dist.is_initialized() and dist.get_world_size(group) > 1:
            with torch.no_grad():
                dist.broadcast(entry.meta.data, src=dist.get_global_rank(group, 0) if group is not None else 0,
                               group=group)

    with _random_states(rank0_states, device):
        _run_calls(skeleton, entries, device, placed, write, report)

    _load_sources(skeleton, entries, placed, write, report)

    missing = [e.names[0] for e in entries.values() if not e.written and e.meta.is_meta]
    if missing:
        raise UninitializedError(
            f"{type(skeleton).__name__} was built on the meta device and nothing initialised "
            f"{', '.join(missing[:8])}{' …' if len(missing) > 8 else ''} ({len(missing)} tensor(s)): no "
            f"reset_parameters() / init_weights() wrote them, so they would train on uninitialised memory. Give "
            f"the module owning each a reset_parameters() that fills it (e.g. nn.init.ones_(self.weight) for a "
            f"norm), or build the model on the CPU."
        )
    report.local_bytes = sum(local_of(t).numel() * local_of(t).element_size() for t in set(targets.values()))
    return report


class _Realiser:
    """Allocates a skeleton tensor in full when initialiser code first reads it from its module (the modules'
    ``_parameters`` / ``_buffers`` are swapped for :class:`_LazySlots`), and writes this rank's part back and
    frees it after each call — or earlier, oldest first, when the live full tensors would exceed ``budget``
    bytes (one tensor is always allowed)."""

    def __init__(self, entries: dict[int, _Entry], device: torch.device,
                 placed: Callable[[_Entry], Optional[tuple[Tensor, Optional[tuple[list[int], int]], Optional[int]]]],
                 write: Callable[[_Entry, Tensor], None], budget: int, report: MaterializeReport) -> None:
        self.entries, self.device, self.placed, self.write = entries, device, placed, write
        self.budget, self.report = budget, report
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
        _fill_unwritten(full)  # NaN / the smallest integer: tells an untouched tensor from a written one
        where = self.placed(entry) if entry.written else None
        if where is not None:
            read_local(where[0], full, where[1], where[2])  # a later initialiser sees the earlier one's values
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
        if now is not None and not now.is_meta and (entry.written or _was_written(now, full)):
            self.write(entry, now.detach())
        del now, full
        if self.device.type == "cpu":  # the writes' transients left at the C heap's top, before the next big tensor
            self.untrimmed += entry.meta.numel() * entry.meta.element_size()
            if self.untrimmed >= _TRIM_EVERY_BYTES:
                release_freed_host_memory()
                self.untrimmed = 0

    def flush(self) -> None:
        while self.live:
            self.release(next(iter(self.live)))


class _LazySlots(dict):  # type: ignore[type-arg]
    """A module's ``_parameters`` / ``_buffers`` whose meta tensors are realised when read."""

    realiser: _Realiser

    def _value(self, value: Optional[Tensor]) -> Optional[Tensor]:
        if isinstance(value, Tensor) and value.is_meta and id(value) in self.realiser.entries:
            return self.realiser.realise(id(value))
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
def _lazy_slots(skeleton: nn.Module, realiser: _Realiser) -> Iterator[None]:
    swapped: list[tuple[nn.Module, str, dict[str, Optional[Tensor]]]] = []
    try:
        for mod in skeleton.modules():
            for attr in ("_parameters", "_buffers"):
                original = mod.__dict__[attr]
                lazy = _LazySlots(original)
                lazy.realiser = realiser
                mod.__dict__[attr] = lazy
                swapped.append((mod, attr, original))
        yield
    finally:
        for mod, attr, original in swapped:
            lazy = mod.__dict__[attr]
            original.clear()
            original.update(dict.items(lazy))
            mod.__dict__[attr] = original


def _run_calls(skeleton: nn.Module, entries: dict[int, _Entry], device: torch.device,
               placed: Callable[[_Entry], Optional[tuple[Tensor, Optional[tuple[list[int], int]], Optional[int]]]],
               write: Callable[[_Entry, Tensor], None], report: MaterializeReport) -> None:
    """Run every initialiser of ``skeleton`` in a single process's order on full tensors allocated as it reads
    them; values are moved into the local shards after each call. A call whose tensors all come from a
    ``fourd_weight_source`` is skipped (their values would be overwritten: pretrained weights are not drawn first)."""
    largest = max((e.meta.numel() * e.meta.element_size() for e in entries.values()), default=0)
    realiser = _Realiser(entries, device, placed, write, max(largest, _MIN_BUDGET), report)
    provided = _source_provided(skeleton, entries)
    calls = [call for call in init_calls(skeleton) if not _all_provided(call, provided)]
    with _lazy_slots(skeleton, realiser):
        for call in calls:
            report.calls += 1
            realiser.call_peak = 0
            try:
                with _MetaWriteGuard(call.label):
                    call.fn()
            finally:
                realiser.flush()
            if realiser.call_peak > report.largest_call_bytes:
                report.largest_call_bytes, report.largest_call = realiser.call_peak, call.label
    for entry in entries.values():  # created for real by the user: a call may have changed them
        if not entry.meta.is_meta:
            write(entry, entry.meta.detach())


_TRIM_EVERY_BYTES = 8 << 20  # trim the C heap after this many bytes of full tensors were released (CPU only)
_MIN_BUDGET = 0  # full tensors kept alive together during one initialiser call beyond the largest one


def _weight_sources(skeleton: nn.Module) -> Iterator[tuple[str, WeightSource]]:
    """``(name prefix, source)`` of every ``fourd_weight_source`` in ``skeleton``."""
    for prefix, mod in skeleton.named_modules():
        source = weight_source(mod)
        if source is None:
            continue
        if not isinstance(source, WeightSource):
            raise TypeError(f"{prefix or type(mod).__name__}.{WEIGHT_SOURCE} must have names() and get(name); "
                            f"got {type(source).__name__}.")
        yield (f"{prefix}." if prefix else ""), source


def _source_provided(skeleton: nn.Module, entries: dict[int, _Entry]) -> set[int]:
    """Keys of the entries some ``fourd_weight_source`` provides."""
    by_name = {name: key for key, entry in entries.items() for name in entry.names}
    return {by_name[pre + rel] for pre, source in _weight_sources(skeleton) for rel in source.names()
            if pre + rel in by_name}


def _all_provided(call: InitCall, provided: set[int]) -> bool:
    """Whether every tensor ``call`` may write (its module's, or its subtree's) comes from a weight source."""
    if not provided:
        return False
    modules = call.module.modules() if call.recurse else [call.module]
    keys = [id(t) for m in modules for t in [*m._parameters.values(), *m._buffers.values()] if t is not None]
    return bool(keys) and all(k in provided for k in keys)


def _load_sources(skeleton: nn.Module, entries: dict[int, _Entry],
                  placed: Callable[[_Entry], Optional[tuple[Tensor, Optional[tuple[list[int], int]], Optional[int]]]],
                  write: Callable[[_Entry, Tensor], None], report: MaterializeReport) -> None:
    """Overwrite the initialised values with those of every ``fourd_weight_source`` in ``skeleton``; a tensor of
    which this rank holds no part (another pipeline stage's) is not read."""
    by_name = {name: entry for entry in entries.values() for name in entry.names}
    for pre, source in _weight_sources(skeleton):
        done: set[int] = set()
        for rel in source.names():
            entry = by_name.get(pre + rel)
            if entry is None or id(entry) in done:
                continue
            done.add(id(entry))
            if placed(entry) is None:
                entry.written = True  # nothing of it lives here: nothing to read
                continue
            full = source.get(rel)
            if tuple(full.shape) != tuple(entry.meta.shape):
                raise ValueError(f"{pre + rel}: the pretrained weights hold shape {tuple(full.shape)}, the model "
                                 f"expects {tuple(entry.meta.shape)}. Is the directory another model's?")
            write(entry, full)
            report.loaded += 1
            del full


def _current(entry: _Entry) -> Optional[Tensor]:
    mod, attr, is_param = entry.slots[0]
    return dict.get(mod._parameters if is_param else mod._buffers, attr)


def _fill_unwritten(full: Tensor) -> None:
    if full.is_floating_point() or full.is_complex():
        full.fill_(float("nan"))
    elif full.dtype != torch.bool:
        full.fill_(torch.iinfo(full.dtype).min)


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
