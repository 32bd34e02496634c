"""Meta -> this rank's shards: layout-independent initial values drawn in pieces, pretrained weights read in
pieces, a rank's slices of the user's tensors, and the host-memory probes that measure it."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    """``lightning_4d.materialize.<name>`` of the module this package replaced: deprecated, from
    :mod:`lightning_4d.materialize.local_shards` (the old names stop working in 0.3)."""
    module = importlib.import_module("lightning_4d.materialize.local_shards")
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module 'lightning_4d.materialize' has no attribute {name!r}")
    warnings.warn(f"lightning_4d.materialize.{name} moved to lightning_4d.materialize.local_shards.{name}; the old "
                  "name stops working in lightning_4d 0.3", DeprecationWarning, stacklevel=2)
    value = globals()[name] = getattr(module, name)  # warned once: ``from ... import`` looks the name up twice
    return value
