"""The set-up model called as the user's own: ``model(x)`` returns the full outputs, equal on every rank that holds
them, so any loss written for one process is exact on them.

What a rewritten model returns by itself is not that. Under tensor parallelism the output head is column-parallel
over the vocabulary (with sequence parallelism it gathers the sequence first), so the logits are a ``DTensor`` of
global shape ``(B, T, V)`` sharded on the vocabulary: each rank holds ``(B, T, V/tp)``. A plain
``F.cross_entropy(logits.flatten(0, 1), targets.flatten())`` refuses a ``DTensor`` next to plain targets, and on the
local shard it would compare ``V/tp`` columns with targets over ``V``. :class:`FullOutputModel` gathers such outputs
(``DTensor.full_tensor``: an all-gather of the logits over ``tp``; its backward is the local slice of the full
gradient, which every tp rank computes alike), so the user's loss sees what one process would. The step function of
the Fabric strategy (``FourDStrategy.train_step``) keeps the logits sharded instead and computes the loss under
``loss_parallel`` (no gathered logits): the memory-lean path, and the only one for pipeline and context parallelism,
whose forward and backward must run inside the schedule / over a sequence shard.

Example:
    >>> # not run: needs a process group
    >>> logits = FullOutputModel(model, record, mesh)(tokens)  # (B, T, V) on every rank  # doctest: +SKIP
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from lightning_4d.core.batches import batch_tokens
from lightning_4d.core.distributed import to_full
from lightning_4d.core.loss import check_inputs
from lightning_4d.layout.parallelize import ParallelPlan
from lightning_4d.layout.pipeline_glue import pipeline_eval
from lightning_4d.mesh import Axis, FourDMesh

__all__ = ["FullOutputModel", "STEP_HINT"]

#: How to train where ``model(x)`` cannot: named by every refusal below.
STEP_HINT = ("call `fabric.strategy.train_step(model, (inputs, targets), loss_fn)` instead, which runs forward, loss "
             "and backward and returns the global-batch loss (see docs/fabric.md)")


class FullOutputModel(nn.Module):
    """``module`` (rewritten by the set-up, its parameters this rank's shards) called like the unsharded model:
    full outputs on every rank (see the module doc).

    - tp / ep / dp: the model's forward, ``DTensor`` outputs gathered.
    - pp: forward only (under ``torch.no_grad()``, e.g. validation): the pipeline schedule runs the batch and every
      pp rank gets the last stage's full outputs. With gradients enabled it refuses, naming the step function.
    - cp: refused (outputs are per sequence shard), naming the step function.

    Args:
        module: the set-up model (its parameter names are the user's, this wrapper adds ``module.``).
        record: what the set-up applied (:class:`~lightning_4d.layout.parallelize.ParallelPlan`: the pipeline
            runner, the traced input shape).
        mesh: the 4D mesh.

    Example:
        >>> # not run: needs a process group
        >>> FullOutputModel(gpt, record, mesh)(tokens).shape  # doctest: +SKIP
        torch.Size([2, 16, 64])
    """

    def __init__(self, module: nn.Module, record: ParallelPlan, mesh: FourDMesh) -> None:
        super().__init__()
        self.module = module
        self.record = record
        self.mesh = mesh

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dims = self.mesh.dims
        if args:  # before any collective: a batch of the wrong rank would be split along the wrong dimension
            check_inputs(batch_tokens(args[0]), self.record.input_shape)
        if dims.cp > 1:
            raise RuntimeError(
                f"model(...) under cp={dims.cp}: every rank holds a shard of each sequence, so the model's outputs "
                f"are per shard and a loss written for the whole sequence would be wrong. To train, {STEP_HINT}; "
                f"`fabric.strategy.eval_step(...)` gives the loss without gradients.")
        runner = self.record.pipeline
        if runner is None:
            return to_full(self.module(*args, **kwargs))
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"model(...) with gradients under pp={dims.pp}: the forward and backward of every micro-batch run "
                f"inside the pipeline schedule, which a backward of your loss cannot reach. To train, {STEP_HINT}. "
                f"Under torch.no_grad() model(...) runs the schedule forward only and returns the full outputs.")
        if kwargs or len(args) != 1:
            raise TypeError(
                f"model(...) under pp={dims.pp} takes the inputs as one positional argument (token ids, or "
                f"PackedInputs(tokens, position_ids)); got {len(args)} positional and keyword(s) {sorted(kwargs)}.")
        return pipeline_eval(runner, self.module, args[0], None, self.mesh[Axis.DP].get_group(), nullcontext)
