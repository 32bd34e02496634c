"""A CPU stand-in for a GPU's host/device boundary: the package's collectives refuse host tensors, as NCCL does.

On a GPU run with NCCL, a host tensor handed to a collective fails on every rank ("No backend type associated with
device type cpu"), and an op mixing host and device tensors fails too ("Expected all tensors to be on the same
device"). On CPU with gloo every tensor lives on the host, so neither can show. :func:`host_tensor_guard` declares a
device for the test — ``cpu:0``, the host's CPU under another name, as ``cuda:0`` is a GPU rank's — makes Lightning's
CPU accelerator hand it out as each rank's root device, and follows every tensor made while it is active:

- *device* tensors: made on the declared device (``device=root_device``, the ``with root_device:`` context of
  Lightning's ``tensor_init_context``), moved there (``.to(root_device)``: ``model_to_device``, Lightning's batch
  transfer), or computed from one;
- *host* tensors: made by a factory (``torch.tensor``, ``zeros``, ``arange``, …) given no device outside a device
  context, or given the string ``"cpu"``; made by ``Tensor.cpu()``; or computed from host tensors alone (views,
  ``.data``, copies);
- any other tensor is unknown: ``torch.device("cpu")`` is what a CPU mesh (FSDP2, DTensor) names and what a tensor's
  ``.device`` reports, host or device alike.

For calls made *from the package* (a caller module named ``lightning_4d…``), every ``torch.distributed`` collective
(also under a module-level alias such as ``_all_gather = dist.…``) then raises :class:`HostTensorError` for a host
tensor; and (``strict_ops``) any op mixing host and device tensors of one or more dimensions raises too (moves,
``copy_`` and indexing excepted, which a GPU allows).

Marks live on storages, so views and ``nn.Parameter`` s share them. Ops that never reach Python — autograd's
backward, DTensor's local ops, FSDP2's C++ copies, ``torch.from_numpy`` — leave their results unmarked: the guard
can miss a host tensor, but marks none that a GPU run would hold on the device. It costs one Python call per torch
function call: use it around small set-up and step runs (a few seconds for a tiny model's fit).

Example:
    >>> # not run: needs a process group
    >>> with host_tensor_guard():  # doctest: +SKIP
    ...     all_reduce_sum(torch.tensor([1.0]))  # HostTensorError: a GPU run would hand NCCL a host tensor
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Generator, Iterable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import CPUAccelerator
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["COLLECTIVES", "DEVICE_STAND_IN", "HostTensorError", "host_tensor_guard", "where"]

#: The device a test declares by default: the host's CPU under another name, as ``cuda:0`` is a GPU rank's.
DEVICE_STAND_IN = torch.device("cpu", 0)

#: The ``torch.distributed`` functions checked (those absent from this torch are skipped). ``isend`` / ``irecv`` stay
#: as they are (``P2POp`` checks their identity): their tensors are checked in ``batch_isend_irecv``.
COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
               "gather", "scatter", "send", "recv", "batch_isend_irecv")

# Ops a GPU allows across host and device tensors: moves, copies into a tensor, indexing with host indices.
_MIXING_ALLOWED = {"to", "cpu", "cuda", "copy_", "__getitem__", "__setitem__", "index_put_", "index_put",
                   "__set__", "__get__", "_has_compatible_shallow_copy_type", "set_", "__deepcopy__"}


class HostTensorError(RuntimeError):
    """A host tensor reached a collective (or met a device tensor in an op) inside :func:`host_tensor_guard`."""


HOST, DEVICE = "host", "device"


class _Marks:
    """The storages of host tensors and of tensors known to be on the device (weakly held: a freed storage leaves
    its set); any other tensor is unknown."""

    def __init__(self) -> None:
        self.sets: dict[str, "weakref.WeakSet[Any]"] = {HOST: weakref.WeakSet(), DEVICE: weakref.WeakSet()}

    @staticmethod
    def _storage(t: torch.Tensor) -> Any:
        if t.is_meta or type(t).__name__ in ("DTensor", "FakeTensor", "FunctionalTensor"):
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, wrapper subclasses
            return None

    def state(self, t: torch.Tensor) -> Optional[str]:
        s = self._storage(t)
        return None if s is None else HOST if s in self.sets[HOST] else DEVICE if s in self.sets[DEVICE] else None

    def set(self, tensors: Iterable[Any], state: Optional[str]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and (s := self._storage(t)) is not None:
                for name, marked in self.sets.items():
                    if name == state:
                        marked.add(s)
                    else:
                        marked.discard(s)


_ACTIVE: list[_Marks] = []


def where(t: torch.Tensor) -> Optional[str]:
    """``"host"``, ``"device"`` or ``None`` (unknown, or no guard active): what the innermost guard knows of ``t``."""
    return _ACTIVE[-1].state(t) if _ACTIVE else None


def _named_device(func: Callable, args: tuple, kwargs: dict) -> Any:
    """The device a call names (``None``: none), as given: a ``torch.device``, a string, an index or a tensor
    (``.to(other)``)."""
    if func is torch.Tensor.to:
        for a in list(args[1:]) + [kwargs.get("device")]:
            if isinstance(a, (torch.device, str, torch.Tensor)) or (isinstance(a, int) and not isinstance(a, bool)):
                return a
        return None
    if func is torch.Tensor.cuda:
        return torch.device("cuda")
    return kwargs.get("device")


class _Tracker(TorchFunctionMode):
    def __init__(self, marks: _Marks, device: torch.device, strict_ops: bool) -> None:
        super().__init__()
        self.marks = marks
        self.device = device
        self.strict_ops = strict_ops

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        states = [self.marks.state(t) for t in inputs]
        name = getattr(func, "__name__", "")
        if self.strict_ops and HOST in states and DEVICE in states and name not in _MIXING_ALLOWED:
            on_host = [tuple(t.shape) for t, m in zip(inputs, states) if m == HOST and t.dim() > 0]
            on_device = [tuple(t.shape) for t, m in zip(inputs, states) if m == DEVICE and t.dim() > 0]
            if on_host and on_device:
                raise HostTensorError(
                    f"Expected all tensors to be on the same device: {name} got host tensor(s) {on_host} and "
                    f"device tensor(s) {on_device} (host-tensor guard: a GPU run fails here)")
        out = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outputs:
            self.marks.set(outputs, self._state_of_result(func, args, kwargs, inputs, states))
        return out

    def _state_of_result(self, func: Callable, args: tuple, kwargs: dict, inputs: list[torch.Tensor],
                         states: list[Optional[str]]) -> Optional[str]:
        if func is torch.Tensor.cpu:
            return HOST
        target = _named_device(func, args, kwargs)
        if isinstance(target, torch.Tensor):
            return self.marks.state(target)
        if target is not None:
            named = torch.device("cuda", target) if isinstance(target, int) else torch.device(target)
            if named == self.device or named.type != "cpu":
                return DEVICE
            # The string "cpu" means the host; torch.device("cpu") is also what a CPU mesh (FSDP2, DTensor) names
            # and what a tensor's .device reports, device or not: unknown.
            return HOST if isinstance(target, str) else None
        if not inputs:
            return HOST  # a factory without a device (a device context passes its device)
        if DEVICE in states:
            return DEVICE
        return HOST if all(m == HOST for m in states) else None


def _check_call(name: str, fn: Callable, marks: _Marks, packages: tuple[str, ...]) -> Callable:
    def checked(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith(packages):
            leaves = tree_leaves((args, kwargs))
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            for op in leaves:  # batch_isend_irecv's P2POps
                if isinstance(op, dist.P2POp):
                    tensors.append(op.tensor)
            for t in tensors:
                if marks.state(t) == HOST:
                    raise HostTensorError(
                        f"No backend type associated with device type cpu: {caller} handed a host tensor "
                        f"{tuple(t.shape)} {t.dtype} to torch.distributed.{name} (host-tensor guard: a GPU backend "
                        f"refuses it; create it with device=… or move it with .to(device) first)")
        return fn(*args, **kwargs)

    checked.__wrapped__ = fn  # type: ignore[attr-defined]
    return checked


@contextmanager
def host_tensor_guard(device: torch.device = DEVICE_STAND_IN, strict_ops: bool = True,
                      packages: tuple[str, ...] = ("lightning_4d",)) -> Generator[None, None, None]:
    """Track host tensors and make the collectives called from ``packages`` refuse them (see the module's doc).

    Args:
        device: the device the test declares (a ``cpu`` device with an index, so that the guard can tell it from
            the host's index-less ``"cpu"``); Lightning's CPU accelerator hands it out as every rank's root device.
        strict_ops: also refuse an op mixing host and device tensors of one or more dimensions.
        packages: module-name prefixes of the callers whose collectives are checked (torch's own internals, which
            move host tensors to the group's device themselves, are not).

    Example:
        >>> # not run: needs a process group
        >>> with host_tensor_guard():  # doctest: +SKIP
        ...     trainer.fit(model)
    """
    marks = _Marks()
    originals = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
    wrapped = {n: _check_call(n, fn, marks, packages) for n, fn in originals.items()}
    by_id = {id(fn): wrapped[n] for n, fn in originals.items()}
    aliases: list[tuple[Any, str, Any]] = []  # (module, attribute, original): e.g. `_all_gather = dist.…`
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(packages):
            continue
        for attr, value in list(vars(mod).items()):
            if id(value) in by_id and not attr.startswith("__"):
                aliases.append((mod, attr, value))
    for n, fn in wrapped.items():
        setattr(dist, n, fn)
    for mod, attr, value in aliases:
        setattr(mod, attr, by_id[id(value)])
    accelerator = CPUAccelerator.get_parallel_devices
    CPUAccelerator.get_parallel_devices = staticmethod(  # type: ignore[method-assign]
        lambda devices: [device] * len(accelerator(devices)))
    _ACTIVE.append(marks)
    try:
        with _Tracker(marks, device, strict_ops):
            yield
    finally:
        _ACTIVE.pop()
        CPUAccelerator.get_parallel_devices = staticmethod(accelerator)  # type: ignore[method-assign]
        for n, fn in originals.items():
            setattr(dist, n, fn)
        for mod, attr, value in aliases:
            setattr(mod, attr, value)
