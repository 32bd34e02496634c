"""The modules that moved into folders by job keep their old import names for one release, with a warning.

``import lightning_4d.trace`` (say) returns :mod:`lightning_4d.analysis.trace` itself — the same module object,
so patches and ``isinstance`` checks agree — and warns with a :class:`DeprecationWarning` naming the new path.

Example:
    >>> MOVED["lightning_4d.layout_plan"]
    'lightning_4d.plan'
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Optional, Sequence

#: old module name -> the module it is now (0.2: the flat top level split into folders by job)
MOVED: dict[str, str] = {f"lightning_4d.{old}": f"lightning_4d.{new}" for old, new in {
    "trace": "analysis.trace", "trace_columns": "analysis.trace_columns",
    "trace_consumers": "analysis.trace_consumers", "trace_records": "analysis.trace_records",
    "head_bias": "analysis.head_bias", "layer_kinds": "analysis.layer_kinds", "discovery": "analysis.discovery",
    "hf_config": "analysis.hf_config", "hooks": "analysis.hooks",
    "batches": "core.batches", "comm": "core.comm", "distributed": "core.distributed",
    "precision": "core.precision", "loss": "core.loss", "metrics": "core.metrics", "verify": "core.verify",
    "derive_plan": "layout.derive_plan", "parallelize": "layout.parallelize",
    "reduced_check": "layout.reduced_check", "expert_replay": "layout.expert_replay",
    "activation_checkpoint": "layout.activation_checkpoint", "data_parallel": "layout.data_parallel",
    "pipeline.glue": "layout.pipeline_glue", "layout_plan": "plan",
    "init_pieces": "materialize.init_pieces", "init_record": "materialize.init_record",
    "load_sources": "materialize.load_sources", "shard_slices": "materialize.shard_slices",
    "host_memory": "materialize.host_memory",
    "step": "runtime.step", "heartbeat": "safety.heartbeat", "peers": "safety.peers",
    "preemption": "safety.preemption", "nonfinite": "safety.nonfinite",
}.items()}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names only; the new module is imported as usual and handed back under the old name."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old name stops working in lightning_4d 0.3",
                      DeprecationWarning, stacklevel=2)  # the import line: warnings skips importlib's frames
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module ran when it was imported under its new name."""


def install() -> None:
    """Let the old names import (idempotent)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
