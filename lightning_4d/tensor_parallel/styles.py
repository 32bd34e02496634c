"""DTensor parallel styles for what torch's own styles do not cover.

- :class:`Colwise` / :class:`Rowwise`: torch's ``ColwiseParallel`` / ``RowwiseParallel`` extended to
  transformers' ``Conv1D`` (GPT-2: weight stored ``[in, out]``) and to fused projections whose output
  is *concatenated* (``q|k|v``): their output rows are permuted so that rank ``r``'s contiguous shard
  holds ``q_r|k_r|v_r`` (see :mod:`lightning_4d.tensor_parallel.layouts`).
- :class:`RegionInput`: the input of an attention / MLP region, gathered to a replicated DTensor, whether
  the block passes it positionally or by keyword (``self.self_attn(hidden_states=...)``).
- :func:`install_sequence_boundary`: sequence parallelism lives inside the blocks: the first block cuts
  the full sequence into this rank's shard, the last one gathers it again, so code around the blocks
  (rotary tables, masks, ``view(output_shape)``) sees the full sequence.

Example:
    >>> from torch import nn
    >>> is_linear(nn.Linear(2, 3)), linear_features(nn.Linear(2, 3))
    (True, (2, 3))
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from lightning_4d.trace import HiddenArg, first_param_name

__all__ = ["Colwise", "Rowwise", "RegionInput", "install_sequence_boundary", "is_conv1d", "is_linear",
           "linear_features"]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D``: ``y = x @ weight + bias`` with ``weight`` of shape ``[in, out]``."""
    w = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2
            and hasattr(module, "nf"))


def is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` or a transformers ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def linear_features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a linear or ``Conv1D``."""
    w = module.weight
    return (int(w.shape[0]), int(w.shape[1])) if is_conv1d(module) else (int(w.shape[1]), int(w.shape[0]))


def _param(module: nn.Module, name: str, tensor: Any) -> None:
    old = getattr(module, name)
    module.register_parameter(name, nn.Parameter(tensor, requires_grad=old.requires_grad))


class Colwise(ColwiseParallel):
    """Column parallel for ``nn.Linear`` and ``Conv1D``; ``permutation`` reorders output features first.

    Example:
        >>> Colwise(permutation=[0, 2, 1, 3]).permutation
        [0, 2, 1, 3]
    """

    def __init__(self, *, permutation: Optional[Sequence[int]] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.permutation = list(permutation) if permutation is not None else None

    def _partition(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        out_dim = 1 if is_conv1d(module) else 0
        for pname, dim in (("weight", out_dim), ("bias", 0)):
            p = getattr(module, pname, None)
            if p is None:
                continue
            data = p.detach()
            if self.permutation is not None:
                data = data.index_select(dim, torch.tensor(self.permutation, device=data.device))
            _param(module, pname, distribute_tensor(data, device_mesh, [Shard(dim)], src_data_rank=self.src_data_rank))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not is_linear(module):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Rowwise(RowwiseParallel):
    """Row parallel for ``nn.Linear`` and ``Conv1D`` (bias replicated).

    Example:
        >>> Rowwise().use_local_output
        True
    """

    def _partition(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        in_dim = 0 if is_conv1d(module) else 1
        _param(module, "weight", distribute_tensor(module.weight.detach(), device_mesh, [Shard(in_dim)],
                                                   src_data_rank=self.src_data_rank))
        if getattr(module, "bias", None) is not None:
            _param(module, "bias", distribute_tensor(module.bias.detach(), device_mesh, [Replicate()],
                                                     src_data_rank=self.src_data_rank))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class RegionInput(ParallelStyle):
    """Gather a region's main input (first argument, positional or keyword) to a replicated DTensor.

    A local tensor is taken as this rank's sequence shard (``sequence_parallel``) or as the full
    replicated activation; one DTensor feeds every column projection of the region, so their input
    gradients are reduced once.

    Example:
        >>> RegionInput(sequence_parallel=True).sequence_parallel
        True
    """

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        keyword = first_param_name(module)
        layout = Shard(1) if self.sequence_parallel else Replicate()

        def to_replicated(x: Any) -> Any:
            if isinstance(x, DTensor):
                return x.redistribute(placements=[Replicate()]) if x.placements != (Replicate(),) else x
            if isinstance(x, torch.Tensor):
                return DTensor.from_local(x, device_mesh, [layout], run_check=False).redistribute(
                    placements=[Replicate()])
            return x

        def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (to_replicated(args[0]),) + tuple(args[1:]), kwargs
            if keyword is not None and keyword in kwargs:
                return args, {**kwargs, keyword: to_replicated(kwargs[keyword])}
            raise ValueError(
                f"tensor-parallel region {type(module).__name__} was called without its input "
                f"({keyword!r}); implement `fourd_tp_plan(self, tp_mesh, sequence_parallel)` for this model."
            )

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def install_sequence_boundary(first: Optional[nn.Module], last: Optional[nn.Module], hidden: HiddenArg,
                              tp_mesh: Any) -> None:
    """Sequence parallelism between the blocks only: ``first`` takes the full hidden state and keeps this
    rank's sequence shard ``(B, T/tp, H)`` (its backward all-gathers the gradient); ``last`` returns the
    full sequence again (an all-gather; its backward keeps the local part of the replicated gradient).
    Either may be ``None`` (not on this pipeline stage).

    Example:
        >>> install_sequence_boundary(model.layers[0], model.layers[-1], HiddenArg(), mesh["tp"])  # doctest: +SKIP
    """

    def scatter(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        full = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)  # (B, T, H)
        return full.redistribute(placements=[Shard(1)]).to_local()  # (B, T/tp, H)

    def gather(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        shard = DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False)  # (B, T/tp, H)
        return shard.redistribute(placements=[Replicate()]).to_local()  # (B, T, H)

    def enter(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return hidden.replace(args, kwargs, scatter(hidden.get(args, kwargs)))

    def leave(_mod: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> Any:
        if hidden.tuple_out is None:
            return gather(out)
        return (gather(out[0]),) + tuple(out[1:])

    if first is not None:
        first.register_forward_pre_hook(enter, with_kwargs=True)
    if last is not None:
        last.register_forward_hook(leave, with_kwargs=True)
