"""``FourDStrategy``: Lightning's lifecycle for 4D parallelism; the work is done by the modules it calls.

Example:
    >>> import lightning as L
    >>> from lightning_4d import FourDStrategy
    >>> # not run: needs a Trainer
    >>> trainer = L.Trainer(strategy=FourDStrategy(tp=2), devices=4, accelerator="cpu")  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import gc
import inspect
import logging
import shutil
import sys
import time
import typing
from contextlib import contextmanager, nullcontext
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterable, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_4d import _compat
from lightning_4d.core.batches import batch_tokens, call_model
from lightning_4d.core.comm import internal_comm
from lightning_4d.checkpoint.background import BackgroundSaver
from lightning_4d.checkpoint.resume import normalize_loop_state, skip_first_batches
from lightning_4d.checkpoint.state import load_sharded, model_state_dict, optimizer_state_dict, save_sharded
from lightning_4d.config import FourDConfig
from lightning_4d.context_parallel import SequenceShard, takes_positions
from lightning_4d.context_parallel.algorithm import choose_algorithm
from lightning_4d.context_parallel.check import ModelInfo, check_context_parallel, example_length
from lightning_4d.layout.data_parallel import set_gradient_sync
from lightning_4d.core.distributed import all_reduce_sum, broadcast_module_state, connect, is_on_meta, to_full
from lightning_4d.safety.heartbeat import Heartbeat
from lightning_4d.safety.nccl_debug import enable_flight_recorder
from lightning_4d.analysis.hooks import TP_PLAN, hook_call
from lightning_4d.core.loss import check_inputs
from lightning_4d.core.precision import exact_fp32_matmul
from lightning_4d.materialize.local_shards import MaterializeReport, materialize_local_shards, meta_skeleton
from lightning_4d.mesh import Axis, FourDMesh, ParallelDims, build_mesh
from lightning_4d.safety.nonfinite import NonFiniteError, SkipStep, check_step
from lightning_4d.layout.parallelize import (
    LayoutRow, ParallelPlan, apply_layout, describe_layout, plan_layout,
)
from lightning_4d.safety.peers import describe_peer_failure, gather_peers
from lightning_4d.layout.pipeline_glue import pipeline_eval
from lightning_4d.plan import LayoutPlan, load_plan
from lightning_4d.layout.reduced_check import check_budget_bytes, check_reduced_model, plan_share_bytes
from lightning_4d.safety.preemption import PreemptionSaver, resolve_signals
from lightning_4d.runtime.step import (
    GradNormShare, after_optimizer_step, clip_grad_norm, finish_backward, grad_norm_share, step_loss,
)
from lightning_4d.runtime.step import loss_context as step_loss_context
from lightning_4d.tensor_parallel.replicas import replica_mismatches
from lightning_4d.analysis.trace import example_tokens

if TYPE_CHECKING:
    from collections.abc import Mapping

    import lightning.pytorch as pl
    from lightning.fabric.strategies.registry import _StrategyRegistry
    from lightning.pytorch.strategies.strategy import TBroadcast, TReduce
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim import Optimizer

    from lightning_4d.safety.peers import Peer

__all__ = ["FIT_SETUP_HOOKS", "FourDStrategy"]

log = logging.getLogger(__name__)

#: Called with the Trainer when a fit starts (after the optimizers are set up). The monitors register theirs —
#: :mod:`lightning_4d.callbacks.summary` swaps Lightning's model summary (which would count this rank's stage)
#: for the whole model's — so the strategy never imports the monitors.
FIT_SETUP_HOOKS: list[Callable[["pl.Trainer"], None]] = []


class FourDStrategy(ParallelStrategy):
    """Tensor (+sequence), pipeline, expert, data and context parallelism for a ``FourDModule``.

    Args:
        **options: every field of :class:`~lightning_4d.config.FourDConfig` (``tp``, ``pp``, ``ep``, ``dp``,
            ``schedule``, ``timeout``, ``nonfinite``, ``preemption_signals``, …), documented there once; the
            signature is generated from that dataclass, in its field order (so they may also be passed
            positionally, as before). Validated together in :attr:`config`.
        **kwargs: the rest go to Lightning's ``ParallelStrategy`` (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``).

    Example:
        >>> strategy = FourDStrategy(tp=2, pp=2, ep=2)
        >>> strategy.config.tp
        2
        >>> list(inspect.signature(FourDStrategy).parameters)[:4]
        ['tp', 'pp', 'ep', 'dp']
    """

    strategy_name = "fourd"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _SIGNATURE.bind(None, *args, **kwargs)  # a TypeError names a positional surplus or a duplicate
        options = {k: v for k, v in bound.arguments.items() if k not in ("self", "kwargs")}
        super().__init__(**bound.arguments.get("kwargs", {}))
        self.config = FourDConfig(**options)
        self._process_group_backend = self.config.process_group_backend  # the chosen one after set-up
        self.skipped_steps = 0  # steps dropped by nonfinite="skip"
        self.parameter_counts: Optional[tuple[int, int]] = None  # whole model (total, trainable), set in setup
        self.module_parameter_counts: dict[str, int] = {}  # whole-model parameters per submodule name
        signals = resolve_signals(self.config.preemption_signals)
        self.preemption = PreemptionSaver(signals, requeue=self.config.preemption_requeue) if signals else None
        self._num_nodes = 1
        self._mesh: Optional[FourDMesh] = None
        self._plan: Optional[ParallelPlan] = None
        self.layout_plan: Optional[LayoutPlan] = None  # the plan applied at set-up (save it: .save(path))
        self._grads_stale = True
        self._grad_share: Optional[GradNormShare] = None  # the guard's gradient-norm share, reused by clipping
        self._replicas_checked = False  # replicated TP parameters are compared after the first step
        self._resume_loops: Optional[dict[str, Any]] = None
        self._peers: list[Peer] = []
        self._heartbeat: Optional[Heartbeat] = None
        self._failed = False
        self.materialize_report: Optional[MaterializeReport] = None  # set when the model was built on meta
        self._cp_shard: Optional[SequenceShard] = None  # cp > 1: this rank's share of the current batch
        self._cp_info: Optional[ModelInfo] = None  # cp > 1: what the set-up check learnt of the model
        self._saver = BackgroundSaver(self.config.timeout) if self.config.async_checkpoint else None

    # ------------------------------------------------------------------ properties
    @property
    def num_nodes(self) -> int:
        """Number of nodes (set by the Trainer)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """Always ``True``: Lightning then adds the distributed sampler and syncs logs."""
        return True

    @property
    def dims(self) -> ParallelDims:
        """The validated degrees (available after ``setup_environment``)."""
        if self._mesh is None:
            raise RuntimeError("The 4D mesh exists only after the Trainer has set up the processes.")
        return self._mesh.dims

    @property
    def mesh(self) -> FourDMesh:
        """The dense ``(pp, dp, tp)`` mesh and the expert ``(pp, edp, ep)`` view."""
        if self._mesh is None:
            raise RuntimeError("The 4D mesh exists only after the Trainer has set up the processes.")
        return self._mesh

    @property
    def device_mesh(self) -> "DeviceMesh":
        """The dense DeviceMesh with axes ``("pp", "dp", "tp")``."""
        return self.mesh.dense

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # TP and PP peers must see the same samples: shard the data over the dp axis only.
        return {"num_replicas": self.dims.dp, "rank": self.mesh.rank(Axis.DP)}

    @property
    def process_group_backend(self) -> Optional[str]:
        """The backend of the default process group."""
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    # ------------------------------------------------------------------ processes and mesh
    @override
    def _configure_launcher(self) -> None:  # Lightning's (private) hook for custom strategies
        assert self.cluster_environment is not None
        _compat.install_subprocess_launcher(self)

    def set_world_ranks(self) -> None:
        """Derive global rank and world size from node rank, local rank and processes per node."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        # Pure validation first: a bad layout fails on every rank before any collective.
        dims = self.config.resolve(self.world_size)
        backend = self._process_group_backend or _compat.default_pg_backend(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        if self.config.nccl_flight_recorder:
            enable_flight_recorder()  # before NCCL starts: it reads the environment then
        connect(self.cluster_environment, backend, self.config.timeout, self.root_device)
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"The existing process group has {dist.get_world_size()} ranks but the Trainer asks for "
                f"{self.world_size} (devices × num_nodes). Make them equal."
            )
        self._mesh = build_mesh(dims, self.root_device.type, backend=backend, timeout=self.config.timeout)

        self._peers = gather_peers()  # (rank, host, pid): a dead peer can be named if a collective fails
        assert self.lightning_module is not None
        _compat.set_device_mesh(self.lightning_module, self._mesh.dense)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self._plan is None:  # a second fit/validate on the same Trainer reuses the layout
            with exact_fp32_matmul():  # the set-up's value checks in full fp32 (TF32 off), the user's choice restored
                self._plan = self._set_up_layout(trainer)
        self.model_to_device()
        self._release_freed_memory()  # what set-up freed on the device: the reduced copy, whole-tensor initialisers
        self.barrier()
        self._start_heartbeat()
        if trainer.state.fn == TrainerFn.FITTING:
            self.optimizers, self.lr_scheduler_configs = [], []  # a re-fit builds them anew
            self.setup_optimizers(trainer)
            if self.preemption is not None and self.preemption not in trainer.callbacks:
                trainer.callbacks.append(self.preemption)  # before a checkpoint is restored
            for hook in FIT_SETUP_HOOKS:
                hook(trainer)
        self.setup_precision_plugin()

    def _set_up_layout(self, trainer: "pl.Trainer") -> ParallelPlan:
        """Rewrite the model for the mesh. A model built on the meta device stays there through the rewrite
        (pipeline pruning, EP, TP/SP, data parallelism) and only this rank's shards are then allocated and
        initialised (:func:`~lightning_4d.materialize.local_shards.materialize_local_shards`), so no rank ever holds the
        whole model; a model built for real is (optionally) synchronised from rank 0 in 64 MB buckets, then
        rewritten."""
        assert self.model is not None
        meta = is_on_meta(self.model)
        if not meta:  # on the device before any collective sees it (NCCL refuses host tensors)
            self.model_to_device()
        # The unsharded model on meta (no memory): initialisation of a meta-built model and the set-up check.
        skeleton = meta_skeleton(self.model)
        buffers = None if meta else {n: b.detach().clone() for n, b in self.model.named_buffers()}
        if not meta and self.config.sync_module_states and self.world_size > 1:
            broadcast_module_state(self.model, src=0)
        self.model = self.precision_plugin.convert_module(self.model)
        params = list(self.model.parameters())  # the whole model, each tied weight once
        self.parameter_counts = (sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))
        self.module_parameter_counts = {name: sum(p.numel() for p in sub.parameters())
                                        for name, sub in self.model.named_modules() if name}
        if self.dims.cp > 1:  # on the whole model: refuse attention that cannot be split, naming the module
            self._check_context_parallel(meta)
        # Plan (one traced forward on the unsharded model, or the given plan checked against it) -> check (the plan
        # applied to a reduced copy with perturbed weights, for every model, before the real one is touched: its
        # memory is gone before this rank's shards exist) -> apply -> materialise.
        dims = self.mesh.dims
        tp_mesh = self.mesh[Axis.TP] if dims.tp > 1 else None
        heads = self._cp_info.heads if self._cp_info is not None else None
        plan = load_plan(self.config.plan) if self.config.plan is not None else \
            plan_layout(self.model, dims, self.config, tp_mesh, attention_heads=heads)
        plan.check(self.model, dims)
        if plan.cp_algorithm == "ulysses" and heads is not None:  # a given plan: the heads must divide
            choose_algorithm("ulysses", heads, dims.cp, dims.tp)
        self.layout_plan = plan
        if self.global_rank == 0:
            log.info("lightning_4d: %s", plan.summary())
        check_reduced_model(skeleton, plan, self.mesh, accumulate=trainer.accumulate_grad_batches,
                            device=self.root_device, buffers=buffers,
                            budget_bytes=self._check_budget(skeleton, plan, meta))
        del buffers
        gc.collect()  # the reduced copy's rewrite leaves reference cycles (hooks, closures) holding its tensors
        self._release_freed_memory()  # the reduced copy's memory, before the shards are allocated
        record = apply_layout(self.model, plan, self.mesh, self.config, self.precision_plugin.precision,
                              accumulate=trainer.accumulate_grad_batches, device=self.root_device)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("lightning_4d: rank %d layout:\n  %s", self.global_rank,
                      "\n  ".join(map(str, describe_layout(self.model))))
        if meta:
            start = time.perf_counter()
            report = materialize_local_shards(skeleton, self.model, self.root_device,
                                              sync_module_states=self.config.sync_module_states,
                                              source_names=plan.source_names())
            del skeleton
            gc.collect()
            self._release_freed_memory()  # the freed full tensors of the initialisation
            self.materialize_report = report
            log.info("lightning_4d: materialised this rank's shards (%.1f MB) in %.1f s, %d of %d initialiser calls "
                     "replayed piece by piece (scratch %.1f MB)%s", report.local_bytes / 2**20,
                     time.perf_counter() - start, report.calls - len(report.whole_calls), report.calls,
                     report.scratch_bytes / 2**20,
                     "; random states differed: rank 0's seed was used" if report.broadcast else "")
            if report.whole_calls and self.global_rank == 0:
                log.warning("lightning_4d: %d initialiser call(s) need tensor values and ran on whole tensors "
                            "(largest %s: %.1f MB in full): %s", len(report.whole_calls), report.largest_call,
                            report.largest_call_bytes / 2**20, "; ".join(report.whole_calls[:8]))
        return record

    def _release_freed_memory(self) -> None:
        """Give back memory the set-up freed: the C heap's to the OS on CPU (``malloc_trim``), the caching
        allocator's unused blocks on CUDA (``torch.cuda.empty_cache()``: they would otherwise stay reserved for this
        process, unusable by NCCL and fragmenting the training's allocations)."""
        if self.root_device.type == "cpu":
            _compat.release_freed_host_memory()
        elif self.root_device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_context_parallel(self, meta: bool) -> None:
        """:func:`~lightning_4d.context_parallel.check.check_context_parallel` on a tiny example (declared and traced
        only for a model on the meta device; with values, a collective over the cp group, for one built for real)."""
        assert self.model is not None
        dims = self.dims
        length = example_length(self.model, dims.cp, dims.tp if dims.sp else 1)
        tokens = example_tokens(self.model, seq=length).to("meta" if meta else self.root_device)  # (2, T)
        with _compat.meta_scalar_mode() if meta else nullcontext():
            self._cp_info = check_context_parallel(self.model, tokens, self.mesh[Axis.CP].get_group(), dims.cp,
                                                   self.mesh.rank(Axis.CP), values=not meta)

    def _check_budget(self, skeleton: torch.nn.Module, plan: LayoutPlan, meta: bool) -> float:
        """Bytes the reduced check may hold, the same on every rank: the option, else
        :func:`~lightning_4d.layout.reduced_check.check_budget_bytes` — for a meta-built model the largest rank's share
        (:func:`~lightning_4d.layout.reduced_check.plan_share_bytes`, from the plan) plus the largest tensor, for one
        built for real the whole model (every rank held it)."""
        if self.config.reduced_check_budget is not None:
            return float(self.config.reduced_check_budget)
        tensors = {id(t): t for t in [*skeleton.parameters(), *skeleton.buffers()]}.values()
        sizes = [t.numel() * t.element_size() for t in tensors]
        if not meta:
            return check_budget_bytes(float(sum(sizes)), 0.0)
        return check_budget_bytes(plan_share_bytes(skeleton, plan, self.mesh.dims), float(max(sizes, default=0)))

    def _start_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop(finished=True)
        self._heartbeat, self._failed = None, False
        if self.config.heartbeat_timeout is not None and self.world_size > 1:
            self._heartbeat = Heartbeat(self.global_rank, self.world_size,
                                        self.config.heartbeat_timeout.total_seconds(), self._peers)
            self._heartbeat.start()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A collective that failed because a peer died gets a first line naming the peer and the collective."""
        super().on_exception(exception)
        self._failed = True

        line = describe_peer_failure(exception, self._peers, self.global_rank)
        if line is None:
            return
        print(f"lightning_4d: {line}", file=sys.stderr, flush=True)
        if exception.args and isinstance(exception.args[0], str) and line not in exception.args[0]:
            exception.args = (f"{line}\n{exception.args[0]}",) + tuple(exception.args[1:])

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.preemption is not None:
            # After Lightning registered its own handlers (its SIGTERM path exits 0 and saves nothing).
            try:
                self.preemption.install()
            except ValueError:  # not the main thread: signals cannot be caught here
                rank_zero_warn("FourDStrategy: not in the main thread, so preemption signals are not caught.")

    @property
    def plan(self) -> Optional[ParallelPlan]:
        """What was applied to the model (set in ``setup``)."""
        return self._plan

    def layout(self) -> list[LayoutRow]:
        """Where each parameter this rank holds lives (mesh dimensions, placements, local shape); logged at
        ``DEBUG`` during set-up.

        Example:
            >>> # not run: needs a Trainer
            >>> print(*trainer.strategy.layout()[:1])  # doctest: +SKIP
            model.layers.0.attention.wk.weight [16, 32] -> [4, 32] [dp:StridedShard(0), tp:S(0)]
        """
        assert self.model is not None
        return describe_layout(self.model)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # Meta tensors are materialised as this rank's shards in `setup`; otherwise built on the root device, as in
        # Lightning's own strategies (then broadcast from there under sync_module_states).
        with torch.device("meta") if empty_init else self.root_device, self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        trainer = self.lightning_module.trainer

        # No gradient reduction on the non-stepping micro-steps of gradient accumulation.
        set_gradient_sync(self.model, not _compat.should_accumulate(trainer))
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self._plan is not None and self._plan.pipeline is not None:
            out = closure_loss  # forward and backward already ran inside the pipeline schedule
        else:
            with self.loss_context():
                out = super().backward(closure_loss, optimizer, *args, **kwargs)
        if not _compat.should_accumulate(self.lightning_module.trainer):
            finish_backward(self._plan, self.mesh, self.model)
        return out

    def _check_replicas(self) -> None:
        """After the first optimizer step: every parameter tensor parallelism left whole must be identical
        on all TP ranks; one that is not (a gradient from sharded activations never summed) fails loudly."""
        with internal_comm():  # a one-time check, not the step's communication
            bad = replica_mismatches(self.model, self.mesh[Axis.TP].get_group())
        if bad:
            raise RuntimeError(
                f"After the first optimizer step these parameters differ across the {self.dims.tp} tensor-parallel "
                f"ranks although each rank holds them whole: {', '.join(bad[:8])}{' …' if len(bad) > 8 else ''}. "
                f"They see sharded activations whose gradients were not summed, so training would go on wrong. "
                f"Implement {hook_call(TP_PLAN)} to shard them, or use tp=1."
            )

    def _guarded(self, closure: Callable[[], Optional[Tensor]], optimizer: Optimizer) -> Optional[Tensor]:
        """Run the step's forward and backward, then stop or skip it on every rank if it is not finite
        (before Lightning clips the gradients and the optimizer steps). The gradient norm's share it tests is
        kept for clipping (unless a grad scaler unscales the gradients in between)."""
        loss = closure()
        trainer = self.lightning_module.trainer
        step = trainer.global_step
        saver = self.preemption
        agreed = [float(saver.received or 0)] if saver is not None else None
        params = [p for group in optimizer.param_groups for p in group["params"]]  # what clipping is handed
        share = grad_norm_share(self._plan, self.model, params)
        self._grad_share = share if getattr(self.precision_plugin, "scaler", None) is None else None
        message = check_step(self.model, loss, step, self.root_device, also_max=agreed, grad_norm_share=share.value)
        if saver is not None and agreed is not None:
            saver.agree(step, int(agreed[0]))  # the batch-end check then needs no collective of its own
        if message is None:
            return loss
        if self.config.nonfinite == "skip":
            raise SkipStep(message)
        raise NonFiniteError(
            f"{message} Training stopped before the optimizer step: the weights (and any checkpoint) are still "
            f"those after step {step - 1 if step else 'initialisation'}. Check the data of this step or lower "
            f"the learning rate; FourDStrategy(nonfinite='skip') skips such steps instead."
        )

    def _log_skipped(self) -> None:
        module = self.lightning_module
        if getattr(module, "_current_fx_name", None) is not None:
            module.log("skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False, prog_bar=False)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None, **kwargs: Any) -> Any:
        if self.config.nonfinite == "off" or self.lightning_module.automatic_optimization is False:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:
            try:
                out = super().optimizer_step(optimizer, partial(self._guarded, closure, optimizer), model, **kwargs)
            except SkipStep as skipped:
                self.skipped_steps += 1
                optimizer.zero_grad(set_to_none=True)
                self._grads_stale = True
                if self.is_global_zero:

                    rank_zero_warn(f"Skipped step ({self.skipped_steps} so far): {skipped}")
                self._log_skipped()
                return None
            finally:
                self._grad_share = None
            if self.config.nonfinite == "skip":
                self._log_skipped()
        self._grads_stale = True
        if not self._replicas_checked and self.dims.tp > 1:
            self._replicas_checked = True
            self._check_replicas()
        after_optimizer_step(self._plan, self.model)  # aux-loss-free balancing: after the step, on every rank
        if self._saver is not None:
            self._saver.poll()  # a failed background save is logged now, raised at the next save / teardown
        return out

    def compute_loss(self, module: "pl.LightningModule", inputs: Any, targets: Any, stage: str = "train") -> Tensor:
        """The global-batch loss for the mixin's steps (:func:`lightning_4d.runtime.step.step_loss`, see
        :mod:`lightning_4d.core.loss`).

        Example:
            >>> # not run: needs a Trainer
            >>> loss = trainer.strategy.compute_loss(module, inputs, targets)  # doctest: +SKIP
        """
        positions = self._cp_info.positions if self._cp_info is not None else takes_positions(module)
        loss, self._cp_shard = step_loss(module, inputs, targets, self._plan, self.mesh, positions, stage,
                                         accumulate=module.trainer.accumulate_grad_batches,
                                         zero_grad=self.zero_grad_if_needed)
        return loss

    def predict(self, module: "pl.LightningModule", inputs: Any) -> Any:
        """Full (unsharded) model outputs on every rank."""
        check_inputs(batch_tokens(inputs), self._plan.input_shape if self._plan is not None else None)
        if self._plan is not None and self._plan.pipeline is not None:
            return pipeline_eval(self._plan.pipeline, module, inputs, None, self.mesh[Axis.DP].get_group(),
                                 self.loss_context)
        return to_full(call_model(module, inputs))

    def zero_grad_if_needed(self) -> None:
        """Zero gradients before the first micro-step of an accumulation window (pipeline mode)."""
        if self._grads_stale:
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
            self._grads_stale = False

    @contextmanager
    def loss_context(self) -> Generator[None, None, None]:
        """Context for computing the loss and its backward (:func:`lightning_4d.runtime.step.loss_context`: ``loss_parallel``
        under TP; with context parallelism the model's attention made global for the current batch)."""
        with step_loss_context(self._plan, self._cp_shard):
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip gradients by the global norm across every tp / pp / ep / dp shard
        (:func:`lightning_4d.runtime.step.clip_grad_norm`).

        Example:
            >>> # not run: needs a Trainer
            >>> trainer.strategy.clip_grad_norm_(model.parameters(), 1.0)  # doctest: +SKIP
        """
        assert self.model is not None
        return clip_grad_norm(self._plan, self.model, parameters, max_norm, norm_type, share=self._grad_share)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(
        self, tensor: TReduce, group: Optional[dist.ProcessGroup] = None,
        reduce_op: Optional[Union[str, dist.ReduceOp]] = "mean",
    ) -> TReduce:
        """Reduce over ``group`` (default: the world; tp/pp peers hold equal values, so the world
        mean is the data-parallel mean)."""
        if not isinstance(tensor, Tensor) or not dist.is_initialized():
            return tensor
        # ReduceOp members print as e.g. "RedOpType.SUM" (torch 2.13) or "ReduceOp.SUM": keep the name.
        op = str(reduce_op).lower().rsplit(".", 1)[-1] if reduce_op is not None else "sum"
        out = tensor.detach().clone() if not tensor.is_floating_point() else tensor.clone()
        if op in ("mean", "avg"):
            out = all_reduce_sum(out.float(), group) / dist.get_world_size(group)
        elif op == "sum":
            out = all_reduce_sum(out, group)
        elif op == "max":
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        elif op == "min":
            dist.all_reduce(out, op=dist.ReduceOp.MIN, group=group)
        else:
            raise ValueError(f"reduce_op={reduce_op!r} is not supported; use 'mean', 'sum', 'max' or 'min'.")
        return out

    @override
    def teardown(self) -> None:
        save_error = self._saver.close() if self._saver is not None else None  # the last save completes first
        if self.preemption is not None:
            self.preemption.restore()
        if self._heartbeat is not None:  # after a failure the peers may notice this rank's silence: intended
            self._heartbeat.stop(finished=not self._failed)
            self._heartbeat = None
        # The default process group is left alone so several Trainers can run in one process.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        if save_error is not None:
            if not self._failed:
                raise save_error
            log.error("lightning_4d: the background checkpoint save failed as well: %s", save_error)

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return model_state_dict(self.model)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in `load_checkpoint`

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return optimizer_state_dict(self.model, optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in `load_checkpoint`

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Union[str, Path],
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("FourDStrategy.save_checkpoint(storage_options=...) is not supported.")
        path = self.broadcast(str(filepath))
        trainer = _compat.attached_trainer(self.lightning_module) if self.lightning_module is not None else None
        if self._saver is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING \
                and trainer.state.status == TrainerStatus.RUNNING:  # after fit nothing would wait: saved at once
            self._saver.save(checkpoint, path, self.is_global_zero, self.root_device, self.config.checkpoint_checksums)
            return
        self.wait_for_checkpoint()
        save_sharded(checkpoint, path, is_global_zero=self.is_global_zero, checksums=self.config.checkpoint_checksums)

    def wait_for_checkpoint(self) -> None:
        """Block until the checkpoint being written in the background (``async_checkpoint=True``) is complete; raise
        its error (every rank). A no-op without one.

        Example:
            >>> FourDStrategy(async_checkpoint=True).wait_for_checkpoint()
        """
        if self._saver is not None:
            self._saver.wait()

    @override
    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.model is not None
        strict = bool(getattr(self.lightning_module, "strict_loading", True))
        self.wait_for_checkpoint()
        meta = load_sharded(self.broadcast(str(checkpoint_path)), self.model, self.optimizers,
                            verify=self.config.checkpoint_checksums, strict=strict)
        # Re-positioned once the training dataloader (and so the epoch length) is known.
        self._resume_loops = copy.deepcopy(meta.get("loops"))
        return meta

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """After a resume, restore the exact loop position and skip the batches already trained on."""
        trainer = self.lightning_module.trainer
        if self._resume_loops is None or not trainer.training or "fit_loop" not in self._resume_loops:
            return dataloader

        loops, self._resume_loops = self._resume_loops, None
        try:
            batches = len(dataloader)
        except TypeError:
            return dataloader  # an iterable without a length: left to Lightning
        skip = normalize_loop_state({"loops": loops}, batches)
        trainer.fit_loop.load_state_dict(loops["fit_loop"])
        return skip_first_batches(dataloader, skip)

    @override
    def remove_checkpoint(self, filepath: Union[str, Path]) -> None:
        if not self.is_global_zero:
            return
        remove = partial(_remove_path, Path(filepath))
        if self._saver is not None:
            self._saver.after_save(remove)  # only once the save in flight is complete (now if none is)
        else:
            remove()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``strategy="fourd"`` with Lightning's registry."""
        if "fourd" not in strategy_registry:
            strategy_registry.register("fourd", cls, description="4D parallelism: TP/SP, PP, EP and DP")


def _remove_path(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _options_signature() -> inspect.Signature:
    """``FourDStrategy.__init__``'s signature: ``self``, the fields of ``FourDConfig`` (their defaults and types),
    then ``**kwargs`` for Lightning."""
    hints = typing.get_type_hints(FourDConfig)
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([
        inspect.Parameter("self", kind),
        *(inspect.Parameter(f.name, kind, default=f.default, annotation=hints[f.name]) for f in fields(FourDConfig)),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation=Any),
    ], return_annotation=None)


_SIGNATURE = _options_signature()
FourDStrategy.__init__.__signature__ = _SIGNATURE  # type: ignore[attr-defined]
FourDStrategy.register_strategies(StrategyRegistry)
