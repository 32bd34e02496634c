"""One rank's real set-up at full scale, in this process: rewrite on meta, then materialise its shards for real.

:func:`simulate_setup` builds rank ``rank`` of a ``dims.world_size``-rank world on torch's ``fake`` process group
(:func:`~lightning_4d.planner.fake_world.fake_world`: collectives return at once), builds the model on the meta
device, applies the layout (:func:`~lightning_4d.layout.parallelize.parallelize_module`, as ``FourDStrategy`` does) and
then allocates and initialises this rank's shards for real
(:func:`~lightning_4d.materialize.local_shards.materialize_local_shards`), measuring the process's peak resident memory
(``VmHWM``, reset first) and the seconds. What it measures is what one GPU rank's host does at set-up; the
planner's set-up term (:func:`lightning_4d.planner.setup_memory.setup_peak_bytes`) is printed beside it by
``recipes/plan.py plan.materialize_rank=R``.

Example:
    >>> # not run: needs a process group (a fake one) and a rank's share of host memory
    >>> simulate_setup(build, ParallelDims.from_world(512, tp=8, pp=8, ep=64), rank=0).describe()  # doctest: +SKIP
    'rank 0 of 512: materialised 8.12 GB of shards ...'
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_4d.config import FourDConfig
from lightning_4d.materialize.host_memory import clear_peak, kernel_peak, rss
from lightning_4d.mesh import ParallelDims

__all__ = ["SetupMeasurement", "simulate_setup"]

GB = 1e9


def _size(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / 2**20:.1f} MiB"


@dataclass
class SetupMeasurement:
    """What :func:`simulate_setup` measured for one rank.

    Example:
        >>> m = SetupMeasurement(rank=0, world_size=8, share_bytes=10**9, peak_bytes=11 * 10**8)
        >>> round(m.ratio(10**9), 2)
        1.1
    """

    rank: int
    world_size: int
    share_bytes: int = 0  # this rank's local parameter and buffer bytes
    peak_bytes: int = 0  # peak resident growth over the process before the model was built
    rewrite_s: float = 0.0  # build on meta + parallelize_module
    materialize_s: float = 0.0  # allocate + initialise this rank's shards (wall clock)
    materialize_cpu_s: float = 0.0  # the same in CPU seconds of this process (robust to a shared machine)
    calls: int = 0  # initialiser calls of the model
    whole_calls: list[str] = field(default_factory=list)  # calls that ran on whole tensors (not replayable)
    scratch_bytes: int = 0

    def ratio(self, estimate_bytes: float) -> float:
        """Measured peak ÷ ``estimate_bytes``."""
        return self.peak_bytes / max(estimate_bytes, 1.0)

    def describe(self, estimate_bytes: Optional[float] = None) -> str:
        """One paragraph for the plan's report (with the planner's estimate when given)."""
        text = (f"set-up of rank {self.rank} of {self.world_size}, run here (fake process group, shards "
                f"materialised for real): share {_size(self.share_bytes)}, peak resident growth "
                f"{_size(self.peak_bytes)}; rewrite on meta {self.rewrite_s:.1f} s, materialise "
                f"{self.materialize_s:.1f} s ({self.materialize_cpu_s:.1f} CPU s; {self.calls - len(self.whole_calls)} of {self.calls} initialiser calls "
                f"replayed piece by piece, scratch {self.scratch_bytes / 2**20:.0f} MiB)")
        if estimate_bytes is not None:
            text += (f"; planner's set-up estimate {_size(estimate_bytes)}: measured / estimate = "
                     f"{self.ratio(estimate_bytes):.3f}")
        return text

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def simulate_setup(build: Callable[[], nn.Module], dims: ParallelDims, rank: int = 0,
                   config: Optional[FourDConfig] = None, precision: str = "32-true") -> SetupMeasurement:
    """Run rank ``rank``'s set-up of the model ``build()`` makes under ``dims`` (module docstring) and measure it.

    Args:
        build: builds the model (a LightningModule or ``nn.Module``) on the current default device; called once
            under ``torch.device("meta")``.
        dims: the layout; its ``world_size`` is the fake group's size.
        rank: the global rank to set up.
        config: the strategy's options (default: ``FourDConfig`` of ``dims``).
        precision: Lightning's precision string (parameters are materialised in its parameter dtype).

    Raises:
        RuntimeError: a process group is already initialised in this process.
        ValueError: ``rank`` is outside the world.

    Example:
        >>> simulate_setup(lambda: nn.Linear(2, 2), ParallelDims.from_world(2), rank=5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: rank 5 is outside the world of 2 ranks ...
    """
    import torch.distributed as dist

    from lightning_4d._compat import clear_dtensor_caches, release_freed_host_memory
    from lightning_4d.materialize.local_shards import materialize_local_shards, meta_skeleton
    from lightning_4d.mesh import build_mesh
    from lightning_4d.layout.parallelize import parallelize_module
    from lightning_4d.planner.dry_run import fake_friendly_mode, strategy_config
    from lightning_4d.planner.spec import TrainSpec
    from lightning_4d.planner.fake_world import fake_world

    if not 0 <= rank < dims.world_size:
        raise ValueError(f"rank {rank} is outside the world of {dims.world_size} ranks (0 ... "
                         f"{dims.world_size - 1}); pick plan.materialize_rank in that range.")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("simulate_setup needs a process without a process group (it creates a fake one).")
    config = config if config is not None else strategy_config(dims, TrainSpec(global_batch_size=dims.dp))
    out = SetupMeasurement(rank=rank, world_size=dims.world_size)
    clear_dtensor_caches()
    gc.collect()
    release_freed_host_memory()
    clear_peak()
    baseline = rss()
    with fake_world(dims.world_size, rank=rank):
        start = time.perf_counter()
        mesh = build_mesh(dims, "cpu")
        with torch.device("meta"):
            module = build()
        skeleton = meta_skeleton(module)
        with fake_friendly_mode():
            record = parallelize_module(module, mesh, config, precision, accumulate=1)
        out.rewrite_s = time.perf_counter() - start
        start, cpu = time.perf_counter(), time.process_time()
        report = materialize_local_shards(skeleton, module, torch.device("cpu"), source_names=record.layout.source_names() if record.layout else {})
        out.materialize_s, out.materialize_cpu_s = time.perf_counter() - start, time.process_time() - cpu
        out.peak_bytes = kernel_peak() - baseline
        out.share_bytes = report.local_bytes
        out.calls, out.whole_calls, out.scratch_bytes = report.calls, list(report.whole_calls), report.scratch_bytes
        del module, skeleton
    gc.collect()
    release_freed_host_memory()
    return out
