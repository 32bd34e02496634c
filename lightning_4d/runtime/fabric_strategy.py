"""The Lightning Fabric strategy's class (Fabric's ``setup_environment`` / ``setup_module`` / ``backward`` /
``clip_gradients`` / ``save`` / ``load`` hooks): the Trainer strategy's set-up and step functions in a loop the user
writes. Imported as :class:`lightning_4d.fabric.FourDStrategy`; the user guide is docs/fabric.md.

Lightning ships one ``ModelParallelStrategy`` class per API (``lightning.fabric.strategies`` and
``lightning.pytorch.strategies``); so does lightning_4d. ``fabric.setup(model, optimizer)`` rewrites a plain
``nn.Module`` (a LitGPT ``GPT``, a Hugging Face model, your own) with the same plan, the same reduced check, the same
rewrite and the same materialisation as :class:`lightning_4d.FourDStrategy` (:func:`~lightning_4d.layout.set_up.
set_up_model`). Then:

- **tp / ep / dp** (sequence parallelism included): the plain Fabric loop works unchanged. ``model(x)`` returns the
  full outputs (:class:`~lightning_4d.runtime.forward.FullOutputModel`), ``fabric.backward(loss)``,
  ``fabric.clip_gradients`` (the global norm over every shard and axis) and ``optimizer.step()`` do the rest. The
  gradient is one process's on the global batch when every rank's loss averages over as many tokens (data
  parallelism averages the ranks' gradients); :meth:`FourDStrategy.train_step` weights by token counts otherwise.
- **pp and cp**: :meth:`FourDStrategy.train_step` runs forward, loss and backward of the loop's batch (through the
  pipeline schedule; over this rank's sequence shard) and returns the global-batch loss; :meth:`eval_step` the same
  without gradients. Under ``torch.no_grad()``, ``model(x)`` also runs the pipeline forward and returns full outputs.
- ``fabric.save`` / ``fabric.load``: sharded DCP checkpoints keyed by the model's own parameter names, so one saved
  under one layout loads under another (:mod:`lightning_4d.checkpoint.fabric_state`).

Options that belong to the Trainer's loop are not taken (:data:`TRAINER_ONLY`):
``fabric.clip_gradients(..., error_if_nonfinite=True)`` (Fabric's default) stops on a non-finite gradient norm.

Example:
    >>> strategy = FourDStrategy(tp=2, pp=2)
    >>> strategy.config.tp, strategy.config.preemption_signals
    (2, ())
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_4d import _compat
from lightning_4d.checkpoint.fabric_state import load_fabric_state, save_fabric_state
from lightning_4d.config import FourDConfig, options_signature
from lightning_4d.context_parallel import takes_positions
from lightning_4d.core.batches import split_batch
from lightning_4d.core.distributed import reduce_tensor
from lightning_4d.core.loss import count_targets
from lightning_4d.layout.data_parallel import set_gradient_sync
from lightning_4d.layout.set_up import (
    ModelSetUp, parameter_names, rebind_optimizer, release_freed_memory, set_up_model,
)
from lightning_4d.mesh import FourDMesh
from lightning_4d.runtime.forward import FullOutputModel
from lightning_4d.runtime.step import after_optimizer_step, check_tp_replicas, clip_grad_norm, finish_backward
from lightning_4d.runtime.step import loss_context, step_loss
from lightning_4d.runtime.world import MeshProperties, connect_mesh

if TYPE_CHECKING:
    from lightning_4d._compat.trainer import StrategyRegistryType

    from lightning_4d.plan import LayoutPlan

__all__ = ["FourDStrategy", "TRAINER_ONLY"]

#: ``FourDConfig`` fields that only the Trainer's loop acts on; Fabric's ``FourDStrategy`` does not take them.
TRAINER_ONLY = ("nonfinite", "preemption_signals", "preemption_requeue", "heartbeat_timeout")
_OFF = {"preemption_signals": (), "heartbeat_timeout": None}  # their values in this strategy's config
_SIGNATURE = options_signature(exclude=TRAINER_ONLY)
LossFn = Callable[[Any, Any], Tensor]


class FourDStrategy(MeshProperties, ParallelStrategy):
    """Tensor (+sequence), pipeline, expert, data and context parallelism for a Lightning Fabric loop.

    Args:
        **options: the fields of :class:`~lightning_4d.config.FourDConfig` (``tp``, ``pp``, ``ep``, ``dp``, ``cp``,
            ``schedule``, ``microbatches``, ``data_parallel``, ``plan``, ...) but :data:`TRAINER_ONLY`; the
            signature is generated from that dataclass, in its field order.
        **kwargs: the rest go to Fabric's ``ParallelStrategy`` (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision``).

    Example:
        >>> FourDStrategy(tp=2).config.tp
        2
    """

    strategy_name = "fourd"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _SIGNATURE.bind(None, *args, **kwargs)  # a TypeError names a positional surplus or a duplicate
        options = {k: v for k, v in bound.arguments.items() if k not in ("self", "kwargs")}
        super().__init__(**bound.arguments.get("kwargs", {}))
        self.config = FourDConfig(**options, **_OFF)
        self._process_group_backend = self.config.process_group_backend  # the chosen one after set-up
        self._num_nodes = 1
        self._mesh: Optional[FourDMesh] = None
        self._model: Optional[nn.Module] = None  # the user's module, rewritten
        self.setup_record: Optional[ModelSetUp] = None  # what `setup_module` did (plan, counts, materialisation)
        self._loss_fn: Optional[LossFn] = None  # the pipeline's loss during `train_step` / `eval_step`
        self._grads_pending = False  # a backward ran since the last once-per-step gradient reductions
        self._replicas_checked = False
        _compat.set_backward_sync_control(self, lambda module, on: set_gradient_sync(_inner(module), on))

    # ------------------------------------------------------------------ properties (more in MeshProperties)
    @property
    def model(self) -> Optional[nn.Module]:
        """The user's module as ``fabric.setup`` rewrote it (this rank's shards and stages; ``None`` before)."""
        return self._model

    @property
    def layout_plan(self) -> Optional["LayoutPlan"]:
        """The layout plan applied by ``fabric.setup`` (``None`` before); print it, or ``.save(path)`` it."""
        return self.setup_record.plan if self.setup_record is not None else None

    # ------------------------------------------------------------------ processes and set-up
    @override
    def _configure_launcher(self) -> None:  # Fabric's (private) hook for custom strategies
        _compat.install_fabric_launcher(self)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        assert self.cluster_environment is not None
        self._mesh, self._process_group_backend = connect_mesh(self.cluster_environment, self.config, self.world_size,
                                                               self.root_device, who="Fabric")

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Rewrite ``module`` for the mesh (plan → reduced check → apply → materialise, as the Trainer's strategy)
        and return it wrapped so that ``model(x)`` gives full outputs (:class:`~lightning_4d.runtime.forward.
        FullOutputModel`). One model per strategy."""
        if self._model is not None:
            raise RuntimeError("FourDStrategy sets up one model per Fabric; it already set up "
                               f"{type(self._model).__name__}. Use one Fabric (and one FourDStrategy) per model.")
        model, self.setup_record = set_up_model(module, self.mesh, self.config, device=self.root_device,
                                                precision=self.precision.precision, loss_fn=self._pipeline_loss,
                                                model_is_root=True)
        model.to(self.root_device)
        release_freed_memory(self.root_device)  # what set-up freed on the device: the reduced copy, initialisers
        self._model = model
        return FullOutputModel(model, self.setup_record.record, self.mesh)

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
                                    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """:meth:`setup_module`, then each optimizer (built on the model before) pointed at this rank's parameters
        by name (:func:`~lightning_4d.layout.set_up.rebind_optimizer`)."""
        names = parameter_names(module)
        wrapped = self.setup_module(module)
        assert self._model is not None
        for optimizer in optimizers:
            rebind_optimizer(optimizer, names, self._model)
        return wrapped, [self.setup_optimizer(o) for o in optimizers], scheduler

    @override
    def module_to_device(self, module: nn.Module) -> None:
        pass  # placed by `setup_module`, after the rewrite (a model may be on the meta device until then)

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """``empty_init=True``: build on the meta device (``fabric.setup`` then materialises this rank's shards only);
        otherwise on this rank's device (broadcast from rank 0 at set-up under ``sync_module_states``)."""
        stack = ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)  # as Lightning's strategies
        stack.enter_context(self.precision.module_init_context())
        return stack

    # ------------------------------------------------------------------ steps
    def train_step(self, model: nn.Module, batch: Any, loss_fn: LossFn, accumulate: int = 1,
                   ignore_index: int = -100) -> Tensor:
        """Forward, loss and backward of ``batch`` (``(inputs, targets)`` with targets shifted, or a dict:
        :func:`~lightning_4d.core.batches.split_batch`) under every layout; returns the global-batch loss (detached,
        equal on every rank). Needed for pp and cp, where ``model(x)`` cannot train; exact under all.

        ``loss_fn(outputs, targets)`` returns the mean over the valid targets (``ignore_index`` excluded); it runs
        where the outputs are (the last pipeline stage, once per micro-batch) on vocabulary-sharded logits under
        ``loss_parallel`` (tp > 1), so ``F.cross_entropy`` works as written. Ranks are weighted by their valid
        targets, so the gradient is one process's on the global batch. With gradient accumulation, pass the
        micro-steps per optimizer step as ``accumulate`` (the gradients are scaled by ``1/accumulate``) and wrap the
        non-stepping calls in ``fabric.no_backward_sync(model)``; then ``optimizer.step()`` /
        ``optimizer.zero_grad()`` as usual.

        Example:
            >>> # not run: needs a process group
            >>> loss = fabric.strategy.train_step(model, (x, y), lambda out, t: F.cross_entropy(
            ...     out.flatten(0, 1), t.flatten()))  # doctest: +SKIP
        """
        if accumulate < 1:
            raise ValueError(f"accumulate={accumulate!r} must be the number of micro-steps per optimizer step (>= 1).")
        loss, pipelined, shard = self._step_loss(model, batch, loss_fn, "train", accumulate, ignore_index)
        if not pipelined:  # the pipeline ran its backward inside the schedule
            with loss_context(self._record(), shard):
                self.backward(loss / accumulate, None)
        self._grads_pending = True
        return loss.detach()

    @torch.no_grad()
    def eval_step(self, model: nn.Module, batch: Any, loss_fn: LossFn, ignore_index: int = -100) -> Tensor:
        """The global-batch loss of ``batch`` without gradients (forward only; through the pipeline under pp), equal
        on every rank: :meth:`train_step`'s value.

        Example:
            >>> # not run: needs a process group
            >>> val_loss = fabric.strategy.eval_step(model, (x, y), loss_fn)  # doctest: +SKIP
        """
        return self._step_loss(model, batch, loss_fn, "val", 1, ignore_index)[0].detach()

    def _step_loss(self, model: nn.Module, batch: Any, loss_fn: LossFn, stage: str, accumulate: int,
                   ignore_index: int) -> tuple[Tensor, bool, Any]:
        module = _inner(model)
        if module is not self._model:
            raise ValueError(f"{type(module).__name__} is not the model this FourDStrategy set up: pass the model "
                             f"`fabric.setup` returned.")
        inputs, targets = split_batch(batch, ignore_index)
        record = self._record()
        info = self.setup_record.cp_info if self.setup_record is not None else None
        positions = info.positions if info is not None else takes_positions(module)
        count = partial(count_targets, ignore_index=ignore_index)
        if record.pipeline is not None:  # the schedule's per-micro-batch counts exclude the same targets
            record.pipeline.token_count_fn = count
        self._loss_fn = loss_fn
        try:
            with self.precision.forward_context():
                loss, shard = step_loss(module, inputs, targets, record, self.mesh, positions, stage,
                                        accumulate=accumulate, loss_fn=loss_fn, count=count)
        finally:
            self._loss_fn = None
        return loss, record.pipeline is not None, shard

    def _pipeline_loss(self, outputs: Any, targets: Any) -> Tensor:
        if self._loss_fn is None:
            raise RuntimeError("the pipeline ran without a loss: train through fabric.strategy.train_step(model, "
                               "batch, loss_fn).")
        return self._loss_fn(outputs, targets)

    def _record(self) -> Any:
        if self.setup_record is None:
            raise RuntimeError("No model was set up: call `fabric.setup(model, optimizer)` first.")
        return self.setup_record.record

    def _finish_gradients(self) -> None:
        """Once per optimizer step, before clipping or stepping: the tp reduction of sequence-parallel partial
        gradients and the tied pipeline weights' sum (:func:`~lightning_4d.runtime.step.finish_backward`)."""
        if self._grads_pending:
            assert self._model is not None
            finish_backward(self._record(), self.mesh, self._model)
            self._grads_pending = False

    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)
        self._grads_pending = True

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._finish_gradients()
        out = super().optimizer_step(optimizer, **kwargs)
        if self._model is not None:
            after_optimizer_step(self._record(), self._model)  # aux-loss-free balancing
            if not self._replicas_checked and self.dims.tp > 1:
                self._replicas_checked = True
                check_tp_replicas(self._model, self.mesh)
        return out

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """Clip by the global norm over every tp / pp / ep / dp / cp shard (one all-reduce of a scalar,
        :func:`~lightning_4d.runtime.step.clip_grad_norm`); returns the norm before clipping, equal on every rank.
        ``error_if_nonfinite=True`` (Fabric's default, as torch's ``clip_grad_norm_``) reads the norm on the host: one
        host sync per step; ``False`` reads nothing."""
        self.precision.unscale_gradients(optimizer)
        self._finish_gradients()
        total = clip_grad_norm(self._record(), _inner(module), self.precision.main_params(optimizer),
                               float(max_norm), float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"The total norm of order {float(norm_type)} of the gradients over every shard is "
                               f"non-finite ({float(total)}), so clipping cannot make them finite. Check this step's "
                               f"data or lower the learning rate; error_if_nonfinite=False clips anyway.")
        return total

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        self._finish_gradients()
        super().clip_gradients_value(module, optimizer, clip_val)

    # ------------------------------------------------------------------ collectives
    @override
    def all_reduce(self, tensor: Tensor, group: Optional[Any] = None,
                   reduce_op: Optional[Union[str, dist.ReduceOp]] = "mean") -> Tensor:
        """Reduce over ``group`` (default: the world; tp/pp peers hold equal values, so the world mean of a
        per-rank loss is its data-parallel mean)."""
        return reduce_tensor(tensor, group, reduce_op) if isinstance(tensor, Tensor) else tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            dist.barrier(device_ids=[self.root_device.index]) if dist.get_backend() == "nccl" else dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src)
        return box[0]

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, path: Union[str, Path], state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Save ``state`` (the set-up model, its optimizers, anything else) as a sharded, crash-safe DCP directory
        at ``path`` (:func:`~lightning_4d.checkpoint.fabric_state.save_fabric_state`): model and optimizer shards
        keyed by the model's own parameter names, so :meth:`load_checkpoint` under another layout reshards them."""
        if storage_options is not None or filter is not None:
            raise TypeError("FourDStrategy.save_checkpoint takes no storage_options or filter: a sharded checkpoint "
                            "holds every shard of the model and optimizers.")
        save_fabric_state(self.broadcast(str(path)), state, self._model, self.is_global_zero,
                          checksums=self.config.checkpoint_checksums, unwrap=_inner)

    @override
    def load_checkpoint(self, path: Union[str, Path], state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]]
                        = None, strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a checkpoint of :meth:`save_checkpoint` (saved under any layout) into ``state``'s model and
        optimizers, in place; the other entries are restored (``load_state_dict`` where they have one, else
        replaced in ``state``) and what ``state`` did not ask for is returned. Each rank's random states are
        restored too. ``strict=False`` loads the parameters both sides have."""
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not isinstance(state, dict) or not state:
            raise ValueError("FourDStrategy.load_checkpoint needs the set-up model to load into: "
                             "fabric.load(path, {'model': model, 'optimizer': optimizer, ...}).")
        return load_fabric_state(self.broadcast(str(path)), state, self._model, strict=strict,
                                 verify=self.config.checkpoint_checksums, unwrap=_inner)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        """Register ``strategy="fourd"`` with Fabric's registry."""
        if "fourd" not in strategy_registry:
            strategy_registry.register("fourd", cls, description="4D parallelism: TP/SP, PP, EP, DP and CP")


def _inner(module: nn.Module) -> nn.Module:
    """The user's rewritten module inside what ``fabric.setup`` returned: Fabric's wrapper (its public ``module``: the
    module as passed to ``setup``, rewritten in place) or the :class:`FullOutputModel` that Fabric hands the
    strategy; any other module as it is."""
    inner = module.module if isinstance(module, FullOutputModel) else getattr(module, "module", module)
    inner = inner.module if isinstance(inner, FullOutputModel) else inner
    return inner if isinstance(inner, nn.Module) else module


FourDStrategy.__init__.__signature__ = _SIGNATURE  # type: ignore[attr-defined]
