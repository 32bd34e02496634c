"""Each attention call's mask, as the set-up check read it, found again while the model trains.

The set-up check (:mod:`.check`) reads the :class:`~.masks.MaskSpec` of every ``F.scaled_dot_product_attention``
call from the mask the model passes on a whole sequence, and names the module that made the call (the innermost one
running) and the call's place among that module's calls. :class:`LayerMasks` keeps them by module; while the model
runs, a forward pre-hook on each of those modules (and its recomputation under activation checkpointing) marks it as
running (:func:`running`), so :class:`~.attention.ContextParallelAttention` takes the call's mask from there, never
from the mask tensor the model built on its local chunk (no host sync, nothing that looks causal at local length).

Example:
    >>> import torch
    >>> from lightning_4d.context_parallel.masks import MaskSpec
    >>> class Attn(torch.nn.Module):
    ...     def forward(self, x):
    ...         return masks.spec(running())
    >>> model = torch.nn.Sequential(Attn())
    >>> masks = LayerMasks.from_names(model, {"0": (MaskSpec("window", 4),)})
    >>> model(torch.zeros(1))
    MaskSpec(kind='window', size=4, documents=False)
"""

from __future__ import annotations

import threading
import weakref
from typing import Mapping, Optional, Sequence

from torch import nn

from lightning_4d.context_parallel.masks import MaskSpec

__all__ = ["Frame", "LayerMasks", "running", "track"]


class Frame:
    """One running forward of a tracked module and the attention calls it has made so far."""

    __slots__ = ("module", "calls")

    def __init__(self, module: nn.Module) -> None:
        self.module, self.calls = module, 0


_STATE = threading.local()  # the frames running on this thread, innermost last
_TRACKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules hooked already (set-up may run again)


def running() -> Optional[Frame]:
    """The innermost tracked module running on this thread, if any."""
    stack = getattr(_STATE, "stack", [])
    return stack[-1] if stack else None


def _push(module: nn.Module) -> None:
    _STATE.stack = [*getattr(_STATE, "stack", []), Frame(module)]


def _pop() -> None:
    _STATE.stack = getattr(_STATE, "stack", [])[:-1]


def track(modules: Sequence[nn.Module]) -> None:
    """Hook ``modules`` (once each) so that :func:`running` names them while they run.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(1, 1); track([lin])
        >>> running() is None
        True
    """
    for module in modules:
        if module in _TRACKED:
            continue
        _TRACKED.add(module)
        module.register_forward_pre_hook(lambda mod, *_: _push(mod))
        module.register_forward_hook(lambda *_: _pop(), always_call=True)


class LayerMasks:
    """The masks of a model's attention calls: per module, its calls' :class:`~.masks.MaskSpec` in order.

    Example:
        >>> import torch
        >>> lm = torch.nn.Sequential(torch.nn.Linear(1, 1))
        >>> LayerMasks.from_names(lm, {"0": (MaskSpec(),)}).describe()
        ["'0': causal"]
    """

    def __init__(self, specs: Mapping[nn.Module, tuple[MaskSpec, ...]], names: Mapping[nn.Module, str]) -> None:
        self._specs: "weakref.WeakKeyDictionary[nn.Module, tuple[MaskSpec, ...]]" = weakref.WeakKeyDictionary(specs)
        self._names: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary(names)
        track(list(specs))

    @classmethod
    def from_names(cls, model: nn.Module, specs: Mapping[str, tuple[MaskSpec, ...]]) -> "LayerMasks":
        """Masks by module name in ``model`` (the set-up check's names; a copy's names find the real modules)."""
        modules = dict(model.named_modules())
        missing = [n for n in specs if n not in modules]
        if missing:
            raise ValueError(f"context parallelism: the set-up check read the masks of module(s) {missing[:3]}, which "
                             f"{type(model).__name__} does not have.")
        return cls({modules[n]: tuple(s) for n, s in specs.items()}, {modules[n]: n for n in specs})

    def name(self, module: nn.Module) -> str:
        return self._names.get(module, type(module).__name__)

    def spec(self, frame: Optional[Frame]) -> Optional[MaskSpec]:
        """The mask of the next attention call in ``frame`` (counted), ``None`` when the set-up check saw no such
        call."""
        if frame is None:
            return None
        specs = self._specs.get(frame.module, ())
        index, frame.calls = frame.calls, frame.calls + 1
        return specs[index] if index < len(specs) else None

    def describe(self) -> list[str]:
        """``'name': mask`` per module, for logs and messages."""
        return [f"{self._names[m]!r}: {', '.join(s.describe() for s in specs)}" for m, specs in self._specs.items()]
