"""``FourDStrategy``: Lightning's lifecycle for 4D parallelism; the work is done by the modules it calls.

Example:
    >>> import lightning as L
    >>> from lightning_4d import FourDStrategy
    >>> # not run: needs a Trainer
    >>> trainer = L.Trainer(strategy=FourDStrategy(tp=2), devices=4, accelerator="cpu")  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import inspect
import logging
import shutil
import sys
from contextlib import contextmanager
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
from lightning_4d.core.batches import batch_tokens
from lightning_4d.checkpoint.background import BackgroundSaver
from lightning_4d.checkpoint.resume import normalize_loop_state, skip_first_batches
from lightning_4d.checkpoint.state import load_sharded, model_state_dict, optimizer_state_dict, save_sharded
from lightning_4d.config import FourDConfig, options_signature
from lightning_4d.context_parallel import SequenceShard, takes_positions
from lightning_4d.context_parallel.check import ModelInfo
from lightning_4d.context_parallel.local_masks import pending_flag, raise_if_differed, verify_local_masks
from lightning_4d.layout.data_parallel import set_gradient_sync
from lightning_4d.core.distributed import reduce_tensor
from lightning_4d.safety.heartbeat import Heartbeat
from lightning_4d.core.loss import check_inputs
from lightning_4d.materialize.local_shards import MaterializeReport
from lightning_4d.mesh import FourDMesh
from lightning_4d.safety.nonfinite import NonFiniteError, SkipStep, check_step
from lightning_4d.layout.parallelize import LayoutRow, ParallelPlan, describe_layout
from lightning_4d.layout.set_up import release_freed_memory, set_up_model
from lightning_4d.safety.peers import describe_peer_failure, gather_peers
from lightning_4d.plan import LayoutPlan
from lightning_4d.safety.preemption import PreemptionSaver, resolve_signals
from lightning_4d.runtime.step import (
    GradNormShare, after_optimizer_step, check_tp_replicas, clip_grad_norm, finish_backward, grad_norm_share,
    predict_outputs, step_loss,
)
from lightning_4d.runtime.step import loss_context as step_loss_context
from lightning_4d.runtime.world import MeshProperties, connect_mesh

if TYPE_CHECKING:
    from collections.abc import Mapping

    import lightning.pytorch as pl
    from lightning_4d._compat.trainer import StrategyRegistryType
    from lightning.pytorch.strategies.strategy import TBroadcast, TReduce
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch.optim import Optimizer

    from lightning_4d.safety.peers import Peer

__all__ = ["FIT_SETUP_HOOKS", "FourDStrategy"]

log = logging.getLogger(__name__)

#: Called with the Trainer when a fit starts (after the optimizers are set up). The monitors register theirs —
#: :mod:`lightning_4d.callbacks.summary` swaps Lightning's model summary (which would count this rank's stage)
#: for the whole model's — so the strategy never imports the monitors.
FIT_SETUP_HOOKS: list[Callable[["pl.Trainer"], None]] = []


class FourDStrategy(MeshProperties, ParallelStrategy):
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

    # ------------------------------------------------------------------ properties (more in MeshProperties)
    @property
    def is_distributed(self) -> bool:
        """Always ``True``: Lightning then adds the distributed sampler and syncs logs."""
        return True

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
        assert self.cluster_environment is not None
        self._mesh, self._process_group_backend = connect_mesh(self.cluster_environment, self.config, self.world_size,
                                                               self.root_device)

        self._peers = gather_peers()  # (rank, host, pid): a dead peer can be named if a collective fails
        assert self.lightning_module is not None
        _compat.set_device_mesh(self.lightning_module, self._mesh.dense)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self._plan is None:  # a second fit/validate on the same Trainer reuses the layout
            self._plan = self._set_up_layout(trainer)
        self.model_to_device()
        release_freed_memory(self.root_device)  # what set-up freed on the device: the reduced copy, whole-tensor inits
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
        """Rewrite the model for the mesh: :func:`~lightning_4d.layout.set_up.set_up_model` (plan → reduced check →
        apply → materialise; a model built on the meta device gets only this rank's shards)."""
        assert self.model is not None
        self.model, done = set_up_model(self.model, self.mesh, self.config, device=self.root_device,
                                        precision=self.precision_plugin.precision,
                                        convert_module=self.precision_plugin.convert_module,
                                        accumulate=trainer.accumulate_grad_batches)
        self.parameter_counts, self.module_parameter_counts = done.parameter_counts, done.module_parameter_counts
        self._cp_info, self.layout_plan, self.materialize_report = done.cp_info, done.plan, done.materialize_report
        return done.record

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

    def _guarded(self, closure: Callable[[], Optional[Tensor]], optimizer: Optimizer) -> Optional[Tensor]:
        """Run the step's forward and backward, then stop or skip it on every rank if it is not finite
        (before Lightning clips the gradients and the optimizer steps). The gradient norm's share it tests is
        kept for clipping (unless a grad scaler unscales the gradients in between)."""
        loss = closure()
        trainer = self.lightning_module.trainer
        step = trainer.global_step
        saver = self.preemption
        agreed: list[Any] = [float(saver.received or 0)] if saver is not None else []
        if self._cp_masks_unread():  # the local masks' check (device flags) rides in the guard's one read
            agreed.append(pending_flag(self.root_device))
        params = [p for group in optimizer.param_groups for p in group["params"]]  # what clipping is handed
        share = grad_norm_share(self._plan, self.model, params)
        self._grad_share = share if getattr(self.precision_plugin, "scaler", None) is None else None
        message = check_step(self.model, loss, step, self.root_device, also_max=agreed or None,
                             grad_norm_share=share.value)
        if saver is not None:
            saver.agree(step, int(agreed[0]))  # the batch-end check then needs no collective of its own
        if self._cp_masks_unread():
            raise_if_differed(agreed[-1])
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
        if _compat.current_hook(module) is not None:
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
            check_tp_replicas(self.model, self.mesh)
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
        guarded = stage == "train" and self.config.nonfinite != "off" and module.automatic_optimization
        if self._cp_masks_unread() and not guarded:  # else checked with the guard's flags (_guarded)
            verify_local_masks(self.root_device)
        return loss

    def predict(self, module: "pl.LightningModule", inputs: Any) -> Any:
        """Full (unsharded) model outputs on every rank (:func:`lightning_4d.runtime.step.predict_outputs`: the
        sequence split over the cp ranks like a training batch)."""
        check_inputs(batch_tokens(inputs), self._plan.input_shape if self._plan is not None else None)
        positions = self._cp_info.positions if self._cp_info is not None else takes_positions(module)
        out = predict_outputs(module, inputs, self._plan, self.mesh, positions)
        if self._cp_masks_unread():
            verify_local_masks(self.root_device)
        return out

    def _cp_masks_unread(self) -> bool:
        """Context parallelism without the set-up check's reading of the masks: each call's local mask is checked
        (:mod:`lightning_4d.context_parallel.local_masks`). The same on every rank."""
        return self.dims.cp > 1 and self._plan is not None and getattr(self._plan, "cp_masks", None) is None

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
        if not isinstance(tensor, Tensor):
            return tensor
        return reduce_tensor(tensor, group, reduce_op)

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
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        """Register ``strategy="fourd"`` with Lightning's registry."""
        if "fourd" not in strategy_registry:
            strategy_registry.register("fourd", cls, description="4D parallelism: TP/SP, PP, EP and DP")


def _remove_path(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


_SIGNATURE = options_signature()
FourDStrategy.__init__.__signature__ = _SIGNATURE  # type: ignore[attr-defined]
FourDStrategy.register_strategies(StrategyRegistry)
