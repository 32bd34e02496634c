"""Shared plumbing of the monitors: cadence, the 4D context of a run, one packed cross-rank gather,
logging, output directories and optional matplotlib figures (Agg canvas).

Every monitor aggregates its numbers with :func:`gather_rows` — one ``all_gather_into_tensor`` of a
small float64 vector per logging step over the world — instead of one ``sync_dist`` all-reduce per
logged key, then logs the already-global values with ``sync_dist=False`` (identical on every rank).
Collectives the monitors issue themselves run inside :func:`internal_comm`, so the
:class:`~lightning_4d.callbacks.CommunicationMonitor` never counts them.

Example:
    >>> every_n(3, 6), every_n(3, 7)
    (True, False)
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from lightning_4d.core.comm import internal_comm, is_internal_comm

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from matplotlib.figure import Figure

    from lightning_4d.config import FourDConfig
    from lightning_4d.mesh import FourDMesh
    from lightning_4d.layout.parallelize import ParallelPlan

__all__ = [
    "RunContext",
    "every_n",
    "gather_rows",
    "internal_comm",
    "is_internal_comm",
    "log_metrics",
    "resolve_every_n",
    "resolve_output_dir",
    "new_figure",
]

def every_n(n: int, step: int) -> bool:
    """Whether ``step`` (0-based) is a sampling step for a cadence of ``n`` (``n <= 0``: never).

    Example:
        >>> [s for s in range(7) if every_n(3, s)]
        [0, 3, 6]
    """
    return n > 0 and step % n == 0


def resolve_every_n(value: Optional[int], trainer: "pl.Trainer") -> int:
    """``value`` or, when ``None``, the Trainer's ``log_every_n_steps`` (Lightning's logging cadence)."""
    if value is None:
        return max(1, int(getattr(trainer, "log_every_n_steps", 50) or 1))
    return int(value)


@dataclass
class RunContext:
    """What a monitor needs to know about the run: the 4D mesh (or ``None``) and the data layout.

    Attributes:
        mesh: ``trainer.strategy.mesh`` for ``FourDStrategy``, else ``None``.
        plan: ``trainer.strategy.plan`` (``None`` outside ``FourDStrategy``).
        config: the strategy's ``FourDConfig`` (``None`` outside ``FourDStrategy``).
        world_size / rank: the default process group's (1 / 0 without one).
        dp: ranks that see different samples (``dims.dp`` under ``FourDStrategy``, else the world).
    """

    mesh: Optional[FourDMesh]
    plan: Optional[ParallelPlan]
    config: Optional[FourDConfig]
    world_size: int
    rank: int
    dp: int

    @classmethod
    def from_trainer(cls, trainer: "pl.Trainer") -> "RunContext":
        """Read the context from ``trainer.strategy`` (any strategy; the 4D parts from ``FourDStrategy``).

        Example:
            >>> # not run: needs a Trainer
            >>> RunContext.from_trainer(trainer).dp  # doctest: +SKIP
            2
        """
        import torch.distributed as dist

        strategy = trainer.strategy
        mesh = plan = config = None
        try:  # FourDStrategy, or anything shaped like it (duck-typed: a mesh with `dims`)
            mesh = getattr(strategy, "mesh", None)
        except RuntimeError:  # FourDStrategy before its processes are set up
            mesh = None
        if mesh is not None and hasattr(mesh, "dims"):
            plan, config = getattr(strategy, "plan", None), getattr(strategy, "config", None)
        else:
            mesh = None
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
        rank = dist.get_rank() if initialized else 0
        dp = mesh.dims.dp if mesh is not None else world
        return cls(mesh=mesh, plan=plan, config=config, world_size=world, rank=rank, dp=dp)

    def degree(self, axis: str) -> int:
        """Degree of a mesh axis (1 without a 4D mesh).

        Example:
            >>> RunContext(None, None, None, 1, 0, 1).degree("tp")
            1
        """
        if self.mesh is None:
            return 1
        dims = self.mesh.dims
        return int(getattr(dims, axis))

    def coordinate(self, axis: str) -> int:
        """This rank's coordinate on a mesh axis (0 without a 4D mesh)."""
        if self.mesh is None or self.degree(axis) == 1:
            return 0
        return int(self.mesh.rank(axis))


def gather_rows(values: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
    """All ranks' 1-D float64 ``values`` as rows of a ``(world, n)`` tensor (one collective; no-op alone).

    Runs inside :func:`internal_comm`. Every rank must call it with the same length.

    Example:
        >>> gather_rows(torch.tensor([1.0, 2.0])).tolist()
        [[1.0, 2.0]]
    """
    import torch.distributed as dist

    row = values.detach().to(dtype=torch.float64).reshape(-1)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return row.unsqueeze(0).cpu()
    if device is not None:
        row = row.to(device)
    out = row.new_empty(dist.get_world_size() * row.numel())  # flat: gloo wants the concatenation
    with internal_comm():
        dist.all_gather_into_tensor(out, row)
    return out.view(dist.get_world_size(), row.numel()).cpu()


def log_metrics(pl_module: "pl.LightningModule", metrics: Mapping[str, float]) -> None:
    """Log already-global values on this rank (no further sync), per step, so they reach
    ``trainer.callback_metrics`` with or without a logger.

    Example:
        >>> # not run: needs a Trainer
        >>> log_metrics(pl_module, {"comm/tp/all_reduce_count": 10.0})  # doctest: +SKIP
    """
    if not metrics:
        return
    pl_module.log_dict(
        {k: float(v) for k, v in metrics.items()}, on_step=True, on_epoch=False, sync_dist=False,
        rank_zero_only=False, batch_size=1, prog_bar=False,
    )


def resolve_output_dir(trainer: "pl.Trainer", dirpath: Optional[str], sub: str) -> str:
    """``dirpath`` or ``<trainer.log_dir>/<sub>`` (``trainer.log_dir`` broadcasts: call on every rank)."""
    if dirpath is not None:
        return os.fspath(dirpath)
    base = trainer.log_dir or trainer.default_root_dir
    return os.path.join(os.fspath(base), sub)


_WARNED: set[str] = set()


def new_figure(**kwargs: Any) -> Optional[Figure]:
    """A matplotlib ``Figure`` drawn by the Agg canvas (no pyplot, the global backend is untouched), or
    ``None`` (warned once) when matplotlib is missing.

    Example:
        >>> new_figure(figsize=(4, 2)).get_size_inches().tolist()  # then fig.savefig("out.png")
        [4.0, 2.0]
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        if "matplotlib" not in _WARNED:
            _WARNED.add("matplotlib")
            warnings.warn("matplotlib is not installed: the monitors skip their PNG figures "
                          "(pip install 'lightning_4d[plot]').", stacklevel=2)
        return None
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig
