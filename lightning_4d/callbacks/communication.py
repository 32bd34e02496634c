"""Communication per training step: count, bytes and time of every collective, per kind and mesh axis.

:class:`CommRecorder` is a ``TorchDispatchMode`` that sees every collective dispatched while it is
active — DTensor's functional collectives (TP/SP), FSDP2 / replicate's ``c10d`` calls (DP),
``torch.distributed`` calls such as the MoE dispatch's ``all_to_all_single`` (EP) and the
pipeline's point-to-point ``send`` / ``recv`` issued by ``isend`` / ``irecv`` /
``batch_isend_irecv`` (PP; torch 2.13 routes them through the ``c10d::send`` / ``c10d::recv_`` ops,
which a dispatch mode sees — the tests check it) — in forward, backward and the optimizer step.

Bytes are what *this rank sends* (recv: what it receives), exactly per call: all-reduce
``2(n−1)/n·S``, all-gather and reduce-scatter ``(n−1)/n·S`` (``S`` the full, gathered tensor),
all-to-all the send buffer minus the chunk the rank keeps (exact for uneven MoE splits), send the
tensor. Seconds are host wall time blocked in the collective: the call itself plus the wait on its
handle — ``Work.wait()`` for ``c10d`` calls (synchronous ones wait inside ``torch.distributed``;
asynchronous FSDP all-gathers and pipeline sends/receives wait later) and ``wait_tensor`` for
functional collectives. To see the ``Work.wait()`` calls, the recorder wraps the
``torch.distributed.Work.wait`` method while it is active and restores it on exit (the one patch;
see :func:`lightning_4d._compat.patch_work_wait`). On CUDA the host waits only for the enqueue unless
``sync_cuda=True`` (device-inclusive times; profiling only).

The dispatch mode sees every tensor operation, so it costs a few microseconds per op: the monitor
records only every ``every_n_steps`` steps (default: the Trainer's ``log_every_n_steps``).

Private torch APIs (``TorchDispatchMode``, the group behind a collective's group argument, the
``Work`` behind a ``c10d`` op's result, the ``Work.wait`` patch, the autograd engine's state) are
used only through :mod:`lightning_4d._compat`.

Example:
    >>> from lightning_4d.callbacks import CommunicationMonitor
    >>> trainer = L.Trainer(strategy=FourDStrategy(tp=2), callbacks=[CommunicationMonitor()])  # doctest: +SKIP
    >>> trainer.fit(model, data)  # doctest: +SKIP
    >>> trainer.callback_metrics["comm/tp/all_reduce_count"]  # doctest: +SKIP
    tensor(13.)
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_4d import _compat
from lightning_4d.callbacks._common import (
    RunContext,
    every_n,
    gather_rows,
    is_internal_comm,
    log_metrics,
    resolve_every_n,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["AXES", "KINDS", "CommEvent", "CommRecorder", "CommunicationMonitor", "axis_groups", "analytic_comm_bytes"]

AXES = ("tp", "dp", "pp", "ep", "edp", "world", "other")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "broadcast")

# op name -> kind, for the namespaces "c10d" (in-place, Work-returning) and "_c10d_functional".
_OPS: dict[str, str] = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "broadcast_": "broadcast", "broadcast": "broadcast",
}
_NAMESPACES = ("c10d", "_c10d_functional")


@dataclass
class CommEvent:
    """One collective seen by :class:`CommRecorder`.

    Attributes:
        kind: one of :data:`KINDS`; axis: one of :data:`AXES`; group_size: ranks in the group.
        bytes: bytes this rank sends (``recv``: receives) in the call.
        seconds: host time in the call and in the wait on its handle.
        backward: issued by the autograd engine (backward pass).
    """

    kind: str
    axis: str
    group_size: int
    bytes: float
    seconds: float
    backward: bool


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _first_tensor(t: Any) -> Optional[torch.Tensor]:
    if isinstance(t, torch.Tensor):
        return t
    if isinstance(t, (list, tuple)):
        for x in t:
            found = _first_tensor(x)
            if found is not None:
                return found
    return None


def _a2a_sent(inp: torch.Tensor, input_splits: Any, n: int, rank: int) -> float:
    """Bytes of ``inp`` (split along dim 0) that leave this rank: all but its own chunk."""
    rows = inp.shape[0] if inp.dim() else 1
    row_bytes = (_nbytes(inp) / rows) if rows else 0.0
    splits = list(input_splits) if input_splits else []
    own = int(splits[rank]) if len(splits) == n and 0 <= rank < n else rows / max(n, 1)
    return (rows - own) * row_bytes


def op_bytes(name: str, kind: str, args: tuple, n: int, rank: int) -> float:
    """Bytes this rank sends (``recv``: receives) for one call of op ``name`` (see the module docstring).

    Example:
        >>> op_bytes("all_reduce", "all_reduce", (torch.zeros(4),), 2, 0)
        16.0
    """
    if kind in ("send", "recv"):
        return float(_nbytes(args[0]))
    if n <= 1:
        return 0.0
    if kind == "all_to_all":
        if name == "alltoall_base_":  # (output, input, group, output_splits, input_splits, ...)
            return float(_a2a_sent(args[1], args[4] if len(args) > 4 else None, n, rank))
        if name == "all_to_all_single":  # (input, output_splits, input_splits, group_name)
            return float(_a2a_sent(args[0], args[2] if len(args) > 2 else None, n, rank))
        return (n - 1) / n * _nbytes(args[1] if name == "alltoall_" else args[0])  # (outputs, inputs, ...)
    if kind == "all_gather":
        if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):  # (output(s), input(s), ...)
            full = _nbytes(args[0])
        elif name in ("allgather_", "allgather_coalesced_"):  # (outputs [[n]], inputs, ...)
            full = _nbytes(args[1]) * n
        else:  # functional: (input(s), group_size, group_name)
            full = _nbytes(args[0]) * n
        return (n - 1) / n * full
    if kind == "reduce_scatter":
        if name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):  # (output(s), input(s), ...)
            full = _nbytes(args[1])
        elif name == "reduce_scatter_":  # (outputs, inputs [[n]], ...)
            full = _nbytes(args[1])
        else:  # functional: (input(s), op, group_size, group_name)
            full = _nbytes(args[0])
        return (n - 1) / n * full
    full = _nbytes(args[0])
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * full
    return (n - 1) / n * full  # broadcast (ring / pipelined estimate)


def axis_groups(mesh: Any) -> dict[Any, tuple[str, ...]]:
    """Mesh axes per process group, keyed by group name and by the tuple of its global ranks (several
    axes when they span the same ranks, e.g. ``tp`` and ``ep`` folded onto one node).

    Matching by ranks too keeps the attribution right when torch hands DTensor an equal group under
    another name (``DeviceMesh`` caches sub-meshes of equal meshes, e.g. across Trainers in one process).

    Example:
        >>> axis_groups(None)
        {}
    """
    import torch.distributed as dist

    out: dict[Any, list[str]] = defaultdict(list)
    if mesh is None:
        return {}
    for axis in ("tp", "dp", "pp", "ep", "edp"):
        try:
            sub = mesh[axis]
            if sub.size() == 1:
                continue
            group = sub.get_group()
            out[group.group_name].append(axis)
            out[tuple(dist.get_process_group_ranks(group))].append(axis)
        except Exception:  # noqa: BLE001 - an axis of size 1 may have no group
            continue
    return {k: tuple(v) for k, v in out.items()}


class CommRecorder(_compat.dispatch_mode_base()):  # type: ignore[misc]
    """Records every collective dispatched while active: :class:`CommEvent` per call (see module docstring).

    Args:
        groups: process-group name or ranks → mesh axes (:func:`axis_groups`); other groups are
            ``"world"`` (the default group) or ``"other"``.
        sync_cuda: synchronise the device at the end of each timed call / wait (device-inclusive times).

    Collectives issued inside :func:`~lightning_4d.callbacks._common.internal_comm` (the monitors' own
    aggregation) are ignored.

    Example:
        >>> with CommRecorder({}) as rec:
        ...     _ = torch.ones(2) + 1
        >>> rec.events, rec.totals()
        ([], {})
    """

    def __init__(self, groups: Optional[Mapping[Any, tuple[str, ...]]] = None, sync_cuda: bool = False) -> None:
        super().__init__()
        self.groups = dict(groups or {})
        self.sync_cuda = sync_cuda
        self.events: list[CommEvent] = []
        self._pending_works: dict[int, tuple[CommEvent, Any]] = {}
        self._pending_tensors: dict[int, tuple[CommEvent, torch.Tensor]] = {}
        self._group_cache: dict[Any, tuple[str, int, int, str]] = {}
        self._patch: Optional[contextlib.AbstractContextManager] = None

    # -- context ---------------------------------------------------------------------------------
    def __enter__(self) -> "CommRecorder":
        self._patch = _compat.patch_work_wait(self._on_wait)
        self._patch.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._patch.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            if self._patch is not None:
                self._patch.__exit__(None, None, None)
                self._patch = None
            self._pending_works.clear()
            self._pending_tensors.clear()

    # -- bookkeeping -----------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.sync_cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def _on_wait(self, work: Any, t0: float, t1: float) -> None:
        entry = self._pending_works.pop(id(work), None)
        if entry is not None:
            self._sync()
            entry[0].seconds += (time.perf_counter() if self.sync_cuda else t1) - t0

    def _axis(self, pg: Any, kind: str) -> str:
        import torch.distributed as dist

        name = pg.group_name
        axes = self.groups.get(name)
        if not axes:
            try:
                axes = self.groups.get(tuple(dist.get_process_group_ranks(pg)))
            except Exception:  # noqa: BLE001
                axes = None
        if axes:
            if kind == "all_to_all":  # expert traffic: prefer the expert axes when groups coincide
                for preferred in ("ep", "edp"):
                    if preferred in axes:
                        return preferred
            return axes[0]
        try:
            if dist.is_initialized() and name == dist.group.WORLD.group_name:
                return "world"
        except Exception:  # noqa: BLE001
            pass
        return "other"

    def _group(self, args: tuple, kwargs: dict, kind: str) -> tuple[str, int, int]:
        for arg in list(args) + list(kwargs.values()):
            if not isinstance(arg, (str, torch.ScriptObject)) and type(arg).__name__ != "ProcessGroup":
                continue
            key = (arg if isinstance(arg, str) else id(arg), kind)
            hit = self._group_cache.get(key)
            if hit is not None:
                return hit[0], hit[1], hit[2]
            pg = _compat.process_group_of(arg)
            if pg is None:
                continue
            info = (self._axis(pg, kind), int(pg.size()), int(pg.rank()), pg.group_name)
            if isinstance(arg, str):
                self._group_cache[key] = info
            return info[0], info[1], info[2]
        return "other", 1, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if _compat.is_higher_order_op(func):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        if any(isinstance(t, type) and issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first desugars into plain collectives, seen next
        namespace = getattr(func, "namespace", "")
        if namespace not in _NAMESPACES:
            return func(*args, **kwargs)
        name = _compat.op_name(func)
        if name == "wait_tensor":
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            entry = self._pending_tensors.pop(id(args[0]), None) if args else None
            if entry is not None:
                self._sync()
                entry[0].seconds += time.perf_counter() - t0
            return out
        kind = _OPS.get(name)
        if kind is None or is_internal_comm():
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - t0
        axis, n, rank = self._group(args, kwargs, kind)
        event = CommEvent(kind, axis, n, op_bytes(name, kind, args, n, rank), seconds, _compat.in_backward())
        self.events.append(event)
        if namespace == "c10d":
            for obj in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(obj, torch.ScriptObject):
                    work = _compat.unbox_work(obj)
                    if work is not None:
                        self._pending_works[id(work)] = (event, work)  # keeps the id unique until waited
        else:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self._pending_tensors[id(t)] = (event, t)
        return out

    # -- results ---------------------------------------------------------------------------------
    def totals(self, backward: Optional[bool] = None) -> dict[tuple[str, str], dict[str, float]]:
        """``{(axis, kind): {"count", "bytes", "seconds"}}``, optionally forward- or backward-only.

        Example:
            >>> CommRecorder().totals()
            {}
        """
        out: dict[tuple[str, str], dict[str, float]] = {}
        for e in self.events:
            if backward is not None and e.backward != backward:
                continue
            entry = out.setdefault((e.axis, e.kind), {"count": 0.0, "bytes": 0.0, "seconds": 0.0})
            entry["count"] += 1
            entry["bytes"] += e.bytes
            entry["seconds"] += e.seconds
        return out

    def clear(self) -> None:
        """Forget the recorded events."""
        self.events.clear()


# ---------------------------------------------------------------------------------------------- analytic
def _find_spec(pl_module: Any, seq_len: int) -> Any:
    from lightning_4d.planner.spec import TransformerSpec

    for module in pl_module.modules():
        if getattr(module, "moe_config", None) is None and getattr(module, "config", None) is None:
            continue
        try:
            return TransformerSpec.from_model(module, seq_len=seq_len)
        except (TypeError, ValueError, AttributeError):
            continue
    return None


def analytic_comm_bytes(
    pl_module: Any, ctx: RunContext, local_batch: int, seq_len: int, precision: str
) -> dict[tuple[str, str], float]:
    """Bytes this rank should send per (axis, kind) in one optimizer step, from the planner's formulas
    (:func:`lightning_4d.planner.comm.comm_per_rank`); ``{}`` when the model has no package config,
    the precision is not modelled or there is no 4D mesh.

    Example:
        >>> analytic_comm_bytes(module, RunContext(None, None, None, 1, 0, 1), 4, 16, "32-true")  # doctest: +SKIP
        {}
    """
    if ctx.mesh is None or ctx.config is None:
        return {}
    precision = {"32": "32-true", "32-true": "32-true", "bf16-mixed": "bf16-mixed"}.get(str(precision))
    if precision is None:
        return {}
    spec = _find_spec(pl_module, seq_len)
    if spec is None:
        return {}
    from lightning_4d.planner.comm import comm_per_rank
    from lightning_4d.planner.spec import TrainSpec

    dims = ctx.mesh.dims
    pipeline = getattr(ctx.plan, "pipeline", None)
    micro = getattr(pipeline, "microbatches", None) or ctx.config.microbatches
    try:
        train = TrainSpec(global_batch_size=local_batch * dims.dp, seq_len=seq_len,
                          microbatches=micro if dims.pp > 1 else None, schedule=ctx.config.schedule,
                          data_parallel=ctx.config.data_parallel, precision=precision,
                          activation_checkpointing=ctx.config.activation_checkpointing)
        records = comm_per_rank(spec, dims, train)[ctx.coordinate("pp")]
    except (ValueError, TypeError, IndexError):
        return {}
    out: dict[tuple[str, str], float] = defaultdict(float)
    for rec in records:
        out[(rec.axis, rec.kind)] += rec.bytes_sent
    return dict(out)


# ---------------------------------------------------------------------------------------------- callback
_FIELDS = ("count", "bytes", "seconds", "analytic")


class CommunicationMonitor(Callback):
    """Logs count, bytes and time of every collective kind per mesh axis for the training step.

    Per recorded step and ``(axis, kind)`` with traffic (axes ``tp dp pp ep edp``, plus ``world`` /
    ``other`` for groups outside the mesh; kinds ``all_reduce all_gather reduce_scatter all_to_all send
    recv broadcast``), the mean over ranks of:

    - ``comm/<axis>/<kind>_count``, ``comm/<axis>/<kind>_bytes`` (bytes sent; ``recv``: received),
      ``comm/<axis>/<kind>_seconds`` (host time in the call and its wait),
    - ``comm/<axis>/<kind>_ratio``: measured bytes / the planner's analytic bytes
      (:func:`analytic_comm_bytes`; only for the package's model configs, without gradient accumulation),

    and ``comm/total_bytes``, ``comm/total_seconds``. The counting context is entered in
    ``on_train_batch_start`` and left in ``on_train_batch_end``, so it covers forward, backward and
    the optimizer step; put this callback first to keep other callbacks' collectives out. A no-op
    without a process group of more than one rank.

    Args:
        every_n_steps: record every N training batches, counted from the start of fit (default:
            ``trainer.log_every_n_steps``); the dispatch mode costs microseconds per tensor op while recording.
        analytic: log the ``_ratio`` keys.
        sync_cuda: device-inclusive times on CUDA (synchronises; for profiling).

    Attributes:
        last_local: this rank's ``{(axis, kind): {"count", "bytes", "seconds"}}`` of the last recorded step.
        last_mean: the same, mean over ranks (what was logged).

    Example:
        >>> monitor = CommunicationMonitor(every_n_steps=1)
        >>> trainer = L.Trainer(strategy=FourDStrategy(tp=2, ep=2), callbacks=[monitor])  # doctest: +SKIP
        >>> trainer.fit(lm, data)  # doctest: +SKIP
        >>> float(trainer.callback_metrics["comm/ep/all_to_all_bytes"])  # doctest: +SKIP
        49152.0
    """

    def __init__(self, every_n_steps: Optional[int] = None, analytic: bool = True, sync_cuda: bool = False) -> None:
        super().__init__()
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be >= 1 (or None for trainer.log_every_n_steps).")
        self.every_n_steps = every_n_steps
        self.analytic = analytic
        self.sync_cuda = sync_cuda
        self.last_local: dict[tuple[str, str], dict[str, float]] = {}
        self.last_mean: dict[tuple[str, str], dict[str, float]] = {}
        self._ctx: Optional[RunContext] = None
        self._groups: dict[Any, tuple[str, ...]] = {}
        self._recorder: Optional[CommRecorder] = None
        self._every = 1
        self._analytic_cache: dict[tuple, dict[tuple[str, str], float]] = {}
        self._shape: Optional[tuple[int, int]] = None
        self._batches = 0

    @property
    def active(self) -> bool:
        """Whether the monitor records anything (a process group of more than one rank)."""
        return self._ctx is not None and self._ctx.world_size > 1

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._ctx = RunContext.from_trainer(trainer)
        self._groups = axis_groups(self._ctx.mesh)
        self._every = resolve_every_n(self.every_n_steps, trainer)

    def _stop(self) -> Optional[CommRecorder]:
        rec, self._recorder = self._recorder, None
        if rec is not None:
            rec.__exit__(None, None, None)
        return rec

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._stop()  # a batch skipped without on_train_batch_end must not leak the mode
        step, self._batches = self._batches, self._batches + 1
        if not self.active or not every_n(self._every, step):
            return
        self._shape = _batch_shape(pl_module, batch)
        self._recorder = CommRecorder(self._groups, sync_cuda=self.sync_cuda).__enter__()

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        rec = self._stop()
        if rec is None:
            return
        assert self._ctx is not None
        local = rec.totals()
        analytic = self._analytic(trainer, pl_module)
        keys = [(a, k) for a in AXES for k in KINDS]
        row = torch.zeros(len(keys) * len(_FIELDS), dtype=torch.float64)
        for i, key in enumerate(keys):
            entry = local.get(key)
            if entry is not None:
                row[i * 4: i * 4 + 3] = torch.tensor([entry["count"], entry["bytes"], entry["seconds"]])
            row[i * 4 + 3] = analytic.get(key, 0.0)
        rows = gather_rows(row, pl_module.device).view(-1, len(keys), len(_FIELDS))  # (world, keys, 4)
        mean = rows.mean(0)
        total = rows.sum(0)
        metrics: dict[str, float] = {}
        self.last_local = local
        self.last_mean = {}
        for i, (axis, kind) in enumerate(keys):
            if total[i, 0] == 0:
                continue
            count, nbytes, seconds = (float(v) for v in mean[i, :3])
            self.last_mean[(axis, kind)] = {"count": count, "bytes": nbytes, "seconds": seconds}
            prefix = f"comm/{axis}/{kind}"
            metrics[f"{prefix}_count"] = count
            metrics[f"{prefix}_bytes"] = nbytes
            metrics[f"{prefix}_seconds"] = seconds
            if total[i, 3] > 0:
                metrics[f"{prefix}_ratio"] = float(total[i, 1] / total[i, 3])
        metrics["comm/total_bytes"] = float(mean[:, 1].sum())
        metrics["comm/total_seconds"] = float(mean[:, 2].sum())
        log_metrics(pl_module, metrics)

    def _analytic(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[tuple[str, str], float]:
        if not self.analytic or self._shape is None or self._ctx is None:
            return {}
        if int(getattr(trainer, "accumulate_grad_batches", 1)) != 1:
            return {}
        key = (self._shape, str(trainer.precision))
        if key not in self._analytic_cache:
            self._analytic_cache[key] = analytic_comm_bytes(pl_module, self._ctx, self._shape[0], self._shape[1],
                                                            str(trainer.precision))
        return self._analytic_cache[key]

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._stop()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._stop()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._stop()


def _batch_shape(pl_module: Any, batch: Any) -> Optional[tuple[int, int]]:
    """``(local batch, sequence length)`` of the inputs of a ``(inputs, targets)`` batch, if 2-D."""
    try:
        split = getattr(pl_module, "split_batch", None)
        inputs = split(batch)[0] if callable(split) else (batch[0] if isinstance(batch, (tuple, list)) else batch)
    except Exception:  # noqa: BLE001 - an unusual batch: no analytic comparison
        return None
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2:
        return int(inputs.shape[0]), int(inputs.shape[1])
    return None
