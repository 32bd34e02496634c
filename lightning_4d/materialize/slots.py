"""The module slots an initialiser call reads while a meta-built model is materialised shard by shard
(:func:`~lightning_4d.materialize.local_shards.materialize_local_shards`): a skeleton tensor's entry, the recording
stand-ins of the first pass and the full tensors the second pass allocates when a whole-tensor call reads them,
written to this rank's shards and freed within a bounded budget.

A skeleton tensor's ``_parameters`` / ``_buffers`` slot holds its meta tensor; inside :func:`lazy_slots` a read of it
gives what the :class:`Slots` policy realises (:class:`Recording`: a memory-less recording tensor; :class:`Realiser`:
the full tensor), and the slots hold meta tensors again after the call.

Example:
    >>> from torch import nn
    >>> skeleton = nn.Linear(2, 2, device="meta")
    >>> entry = Entry(names=["weight"], meta=skeleton.weight, slots=[(skeleton, "weight", True)])
    >>> current(entry).is_meta
    True
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_4d._compat import release_freed_host_memory, returnable_host_empty
from lightning_4d._compat.modules import TENSOR_SLOTS, tensor_slots
from lightning_4d.materialize.init_pieces import CHUNK_ELEMENTS, Region, Step, evaluate, unwritten_fill
from lightning_4d.materialize.init_record import Recorder, RecordingTensor
from lightning_4d.materialize.shard_slices import read_local

__all__ = ["Entry", "Place", "Realiser", "Recording", "Slots", "current", "lazy_slots", "was_written"]

Place = tuple[Tensor, Optional[tuple[list[int], int]], Optional[int]]  # (target, TP row permutation, stack index)


@dataclass
class Entry:
    """One distinct tensor of the skeleton, every place it goes in the rewritten model, and what the initialisers
    recorded for it since its last whole-tensor write."""

    names: list[str]
    meta: Tensor
    slots: list[tuple[nn.Module, str, bool]] = field(default_factory=list)  # (module, attribute, is_parameter)
    written: bool = False  # set by a whole-tensor call, or by a source
    steps: list[Step] = field(default_factory=list)  # to apply on top of the base (NaN, or the local values)
    defined: list[Region] = field(default_factory=list)  # regions every defining step wrote (coverage)
    base_local: bool = False  # a whole-tensor call wrote the targets: steps apply on top of their values


class Slots:
    """What a module's ``_parameters`` / ``_buffers`` give for a meta tensor of the skeleton while a call runs."""

    entries: dict[int, Entry]

    def realise(self, key: int) -> Tensor:
        raise NotImplementedError

    def settle(self, skeleton: nn.Module) -> None:
        """After the call: the skeleton's slots hold meta tensors again."""


class Recording(Slots):
    """A memory-less :class:`~lightning_4d.materialize.init_record.RecordingTensor` per tensor (the same object for every
    read within a call, so ``a.weight is b.weight`` holds for tied weights)."""

    def __init__(self, entries: dict[int, Entry], recorder: Recorder) -> None:
        self.entries, self.recorder = entries, recorder
        self.made: dict[int, Tensor] = {}

    def realise(self, key: int) -> Tensor:
        if key not in self.made:
            entry = self.entries[key]
            value = self.recorder.tensor(key, entry.meta, parameter=isinstance(entry.meta, nn.Parameter))
            for mod, attr, is_param in entry.slots:
                dict.__setitem__(tensor_slots(mod, is_param), attr, value)
            self.made[key] = value
        return self.made[key]

    def settle(self, skeleton: nn.Module) -> None:
        for mod in skeleton.modules():  # the call may have assigned a stand-in elsewhere (a re-tie)
            for slots in (tensor_slots(mod), tensor_slots(mod, parameters=False)):
                for attr, value in list(dict.items(slots)):
                    if isinstance(value, RecordingTensor):
                        dict.__setitem__(slots, attr, self.entries[value._key].meta)


class Realiser(Slots):
    """Allocates a skeleton tensor in full when a whole-tensor call first reads it from its module, holding the
    values recorded so far (this rank's part of a base a previous whole-tensor call wrote), and writes this rank's
    part to the targets and frees it after the call — or earlier, oldest first, when the live full tensors would
    exceed ``budget`` bytes (one tensor is always allowed)."""

    def __init__(self, entries: dict[int, Entry], device: torch.device, places: Callable[[Entry], list[Place]],
                 write: Callable[[Entry, Tensor], None], budget: int) -> None:
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
            dict.__setitem__(tensor_slots(mod, is_param), attr, value)
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
        now = current(entry)
        for mod, attr, is_param in entry.slots:
            dict.__setitem__(tensor_slots(mod, is_param), attr, entry.meta)
        if now is not None and not now.is_meta and (entry.written or entry.steps or entry.base_local
                                                    or was_written(now, full)):
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


class LazySlots(dict):  # type: ignore[type-arg]
    """A module's ``_parameters`` / ``_buffers`` whose meta tensors are realised when read."""

    slots: Slots

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
def lazy_slots(skeleton: nn.Module, slots: Slots) -> Iterator[None]:
    swapped: list[tuple[nn.Module, str, dict[str, Optional[Tensor]]]] = []
    try:
        for mod in skeleton.modules():
            for attr in TENSOR_SLOTS:
                original = mod.__dict__[attr]
                lazy = LazySlots(original)
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


_TRIM_EVERY_BYTES = 8 << 20  # trim the C heap after this many bytes of full tensors were released (CPU only)


def current(entry: Entry) -> Optional[Tensor]:
    mod, attr, is_param = entry.slots[0]
    return dict.get(tensor_slots(mod, is_param), attr)


def was_written(now: Tensor, full: Tensor) -> bool:
    """A call wrote the tensor unless it left every element as allocated (see :func:`~lightning_4d.materialize.init_pieces.unwritten_fill`)."""
    if now is not full and now.data_ptr() != full.data_ptr():
        return True  # the call assigned a new tensor
    if not now.numel() or now.dtype == torch.bool:
        return True  # nothing to tell apart: trust the call
    flat = now.reshape(-1)
    unwritten = (lambda part: torch.isnan(part).all()) if now.is_floating_point() or now.is_complex() \
        else (lambda part: (part == torch.iinfo(now.dtype).min).all())
    step = 1 << 20  # chunks: no whole-tensor mask; the first written chunk ends the scan
    return not all(bool(unwritten(flat[i:i + step])) for i in range(0, flat.numel(), step))
