"""Which sliding window the running attention uses, so context parallelism can recompute it from global positions.

A sliding-window causal mask is one more predicate on ``(query position, key position)``: ``0 <= q - k < window``
(transformers' ``sliding_window_overlay``), combined with the document mask of packed batches. The window of an
attention call is not visible in ``F.scaled_dot_product_attention``'s arguments (the model folds it into the mask
it builds from its local chunk), so it is read from the modules that declare it, innermost first, while they run:

- a module's own ``sliding_window`` attribute (an ``int``, or ``None`` for a full-attention layer: transformers'
  Qwen2 / Gemma 3 attention modules set it per layer type);
- LitGPT's per-layer ``apply_sliding_window_attention`` flag, the window being its config's
  ``sliding_window_size``;
- else a ``config`` whose ``sliding_window`` applies to every layer (no ``layer_types``, or only
  ``sliding_attention`` ones: Mistral); a config mixing layer types without a per-module attribute is
  :data:`MIXED` (refused at the call: which layer is which cannot be told).

Example:
    >>> import torch
    >>> class Local(torch.nn.Module):
    ...     sliding_window = 4
    ...     def forward(self, x):
    ...         return current_window()
    >>> model = torch.nn.Sequential(Local())
    >>> handles = track_windows(model)
    >>> model(torch.zeros(1)), current_window()
    (4, None)
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional, Union

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["MIXED", "current_window", "declared_window", "track_windows"]

#: A config declares a window for some layer types only and the running module does not say which it is.
MIXED = "mixed"
Window = Union[int, None, str]  # a window in tokens, None (full attention), or MIXED

_NOT_DECLARED = object()
_STATE = threading.local()  # the windows of the modules running on this thread, innermost last
_TRACKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules hooked already (set-up may run again)


def _window_value(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def declared_window(module: nn.Module) -> Any:
    """The window ``module`` declares for the attention calls inside it (see the module doc): an ``int``, ``None``
    (full attention), :data:`MIXED`, or a private marker when it declares nothing. Pure.

    Example:
        >>> import torch
        >>> class Attn(torch.nn.Module):
        ...     sliding_window = None
        >>> declared_window(Attn()) is None
        True
    """
    if "sliding_window" in vars(module) or "sliding_window" in vars(type(module)):
        return _window_value(getattr(module, "sliding_window"))
    config = getattr(module, "config", None)
    if "apply_sliding_window_attention" in vars(module):  # LitGPT: a per-layer flag, the window in its config
        return _window_value(getattr(config, "sliding_window_size", None)) if module.apply_sliding_window_attention \
            else None
    if config is None or _window_value(getattr(config, "sliding_window", None)) is None:
        return _NOT_DECLARED
    layer_types = getattr(config, "layer_types", None) or ()
    if not layer_types or all(t == "sliding_attention" for t in layer_types):
        return _window_value(config.sliding_window)
    return MIXED if "sliding_attention" in layer_types else _NOT_DECLARED


def current_window() -> Window:
    """The window of the innermost running module that declares one (``None``: full attention, or none declared).

    Example:
        >>> current_window() is None
        True
    """
    stack = getattr(_STATE, "stack", [])
    return stack[-1] if stack else None


def _push(window: Window) -> None:
    _STATE.stack = [*getattr(_STATE, "stack", []), window]


def _pop() -> None:
    _STATE.stack = getattr(_STATE, "stack", [])[:-1]


def track_windows(model: nn.Module) -> list[RemovableHandle]:
    """Hooks on every module of ``model`` that declares a window: while it runs (forward, and its recomputation
    under activation checkpointing), :func:`current_window` answers its window. Returns the hook handles.

    Example:
        >>> import torch
        >>> track_windows(torch.nn.Linear(2, 2))  # declares nothing: no hooks
        []
    """
    handles: list[RemovableHandle] = []
    for sub in model.modules():
        window = declared_window(sub)
        if window is _NOT_DECLARED or sub in _TRACKED:
            continue
        _TRACKED.add(sub)
        handles.append(sub.register_forward_pre_hook(lambda *_, w=window: _push(w)))
        handles.append(sub.register_forward_hook(lambda *_: _pop(), always_call=True))
    return handles
