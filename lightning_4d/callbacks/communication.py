"""Communication per training step: count, bytes and time of every collective, per kind and mesh axis.

:class:`CommRecorder` is the package's one collective recorder (:class:`lightning_4d.core.comm.CommCounter`, a
``TorchDispatchMode``) naming groups by mesh axis and timing each call. It sees DTensor's functional
collectives (TP/SP), FSDP2 / replicate's ``c10d`` calls (DP), ``torch.distributed`` calls such as the MoE
dispatch's ``all_to_all_single`` (EP) and the pipeline's point-to-point ``send`` / ``recv`` issued by
``isend`` / ``irecv`` / ``batch_isend_irecv`` (PP; torch 2.13 routes them through the ``c10d::send`` /
``c10d::recv_`` ops, which a dispatch mode sees — the tests check it) — in forward, backward and the
optimizer step. Bytes are what *this rank sends* (recv: what it receives), exactly per call
(:func:`lightning_4d.core.comm.op_bytes`). Seconds are host wall time blocked in the collective: the call itself
plus the wait on its handle — ``Work.wait()`` for ``c10d`` calls (synchronous ones wait inside ``torch.distributed``;
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
    >>> # not run: needs a Trainer
    >>> trainer = L.Trainer(strategy=FourDStrategy(tp=2), callbacks=[CommunicationMonitor()])  # doctest: +SKIP
    >>> trainer.fit(model, data)  # doctest: +SKIP
    >>> trainer.callback_metrics["comm/tp/all_reduce_count"]  # doctest: +SKIP
    tensor(13.)
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_4d import _compat
from lightning_4d.core.batches import batch_tokens
from lightning_4d.core.comm import AXIS_ORDER, CommCounter, CommRecord, mesh_axis_groups
from lightning_4d.core.precision import PRECISION_NAMES, precision_info
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
    import torch.distributed as dist
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from lightning_4d._compat.dispatch import OperatorBase

    from lightning_4d.planner.spec import TransformerSpec

__all__ = ["AXES", "KINDS", "CommEvent", "CommRecorder", "CommunicationMonitor", "analytic_comm_bytes"]

AXES = AXIS_ORDER + ("world", "other")  # every name :func:`lightning_4d.core.comm.axis_of_group` gives
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "broadcast")

CommEvent = CommRecord  # one collective seen by :class:`CommRecorder` (the package's one record type)


class CommRecorder(CommCounter):
    """:class:`lightning_4d.core.comm.CommCounter` naming axes by mesh group and timing each call and its wait.

    Args:
        groups: process-group name or ranks → mesh axes (:func:`lightning_4d.core.comm.mesh_axis_groups`), named by
            the package's one namer (:func:`lightning_4d.core.comm.axis_of_group`).
        sync_cuda: synchronise the device at the end of each timed call / wait (device-inclusive times).

    Collectives issued inside :func:`~lightning_4d.callbacks._common.internal_comm` (the monitors' own
    aggregation) are ignored.

    Example:
        >>> with CommRecorder({}) as rec:
        ...     _ = torch.ones(2) + 1
        >>> rec.records, rec.totals()
        ([], {})
    """

    def __init__(self, groups: Optional[Mapping[Union[str, tuple[int, ...]], tuple[str, ...]]] = None,
                 sync_cuda: bool = False) -> None:
        super().__init__(groups)
        self.sync_cuda = sync_cuda
        self._pending_works: dict[int, tuple[CommRecord, dist.Work]] = {}
        self._pending_tensors: dict[int, tuple[CommRecord, torch.Tensor]] = {}
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

    def __exit__(self, *exc: object) -> Optional[bool]:
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

    def _on_wait(self, work: dist.Work, t0: float, t1: float) -> None:
        entry = self._pending_works.pop(id(work), None)
        if entry is not None:
            self._sync()
            entry[0].seconds += (time.perf_counter() if self.sync_cuda else t1) - t0

    def skip(self) -> bool:
        return is_internal_comm()

    def issued(self, record: CommRecord, namespace: str, out: Any) -> None:
        if namespace == "c10d":
            for obj in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(obj, torch.ScriptObject):
                    work = _compat.unbox_work(obj)
                    if work is not None:
                        self._pending_works[id(work)] = (record, work)  # keeps the id unique until waited
        else:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self._pending_tensors[id(t)] = (record, t)

    def __torch_dispatch__(self, func: OperatorBase, types: tuple[type, ...], args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        if getattr(func, "namespace", "") != "_c10d_functional" or _compat.op_name(func) != "wait_tensor":
            return super().__torch_dispatch__(func, types, args, kwargs)
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        entry = self._pending_tensors.pop(id(args[0]), None) if args else None
        if entry is not None:
            self._sync()
            entry[0].seconds += time.perf_counter() - t0
        return out

    # -- results ---------------------------------------------------------------------------------
    def totals(self, backward: Optional[bool] = None) -> dict[tuple[str, str], dict[str, float]]:
        """``{(axis, kind): {"count", "bytes", "seconds"}}`` (bytes sent), optionally forward- or backward-only.

        Example:
            >>> CommRecorder().totals()
            {}
        """
        return {k: {"count": float(v["count"]), "bytes": v["sent_bytes"], "seconds": v["seconds"]}
                for k, v in super().totals(backward).items()}

    def clear(self) -> None:
        """Forget the recorded events."""
        self.records.clear()


# ---------------------------------------------------------------------------------------------- analytic
def _find_spec(pl_module: torch.nn.Module, seq_len: int) -> Optional[TransformerSpec]:
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
    pl_module: torch.nn.Module, ctx: RunContext, local_batch: int, seq_len: int, precision: str
) -> dict[tuple[str, str], float]:
    """Bytes this rank should send per (axis, kind) in one optimizer step, from the planner's formulas
    (:func:`lightning_4d.planner.comm.comm_per_rank`); ``{}`` when the model has no package config,
    the precision is not modelled or there is no 4D mesh.

    Example:
        >>> analytic_comm_bytes(torch.nn.Linear(2, 2), RunContext(None, None, None, 1, 0, 1), 4, 16, "32-true")
        {}
    """
    if ctx.mesh is None or ctx.config is None:
        return {}
    known = precision_info(precision) if str(precision) in PRECISION_NAMES else None
    if known is None or not known.modelled_exactly:
        return {}  # the planner's formulas do not hold for it
    precision = known.name
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
        >>> # not run: needs a Trainer
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
        self._groups: dict[Union[str, tuple[int, ...]], tuple[str, ...]] = {}
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
        self._groups = mesh_axis_groups(self._ctx.mesh)
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
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: STEP_OUTPUT,
                           batch: Any, batch_idx: int) -> None:
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


def _batch_shape(pl_module: "pl.LightningModule", batch: Any) -> Optional[tuple[int, int]]:
    """``(local batch, sequence length)`` of the inputs of a ``(inputs, targets)`` batch, if 2-D."""
    try:
        split = getattr(pl_module, "split_batch", None)
        inputs = split(batch)[0] if callable(split) else (batch[0] if isinstance(batch, (tuple, list)) else batch)
        inputs = batch_tokens(inputs)  # packed documents: the token ids
    except Exception:  # noqa: BLE001 - an unusual batch: no analytic comparison
        return None
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2:
        return int(inputs.shape[0]), int(inputs.shape[1])
    return None
